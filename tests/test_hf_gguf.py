"""`inferflow convert HF_DIR -o X.gguf` writes a llama.cpp model: llama.cpp's names, hyperparameter
keys with the value types llama.cpp checks, the BPE tokenizer (byte-level or sentencepiece's) and
chat template, llama's q/k rows permuted for llama.cpp's rope, Gemma's norms as 1 + w and GPT-2's
Conv1D weights transposed. Checked here against transformers (the same
logits from the GGUF as from the HF model, the same token ids from the GGUF's tokenizer) and
gguf-py (what the file declares); llama.cpp itself runs these files in
test_llama_cpp_interchange.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer

from inferflow.convert import convert_checkpoint
from inferflow.errors import CheckpointError
from inferflow.quantize import quantize_checkpoint
from inferflow.runtime import load
from tests.conftest import all_logits, gemma3_path, randomize, smollm2_path

PROMPTS = ("The capital of France is", "def fibonacci(n):\n    return", "<|im_start|>user\nHi")


def tiny_hf(
    out: Path, model_type: str = "llama", tied: bool = False, vocab: Path | None = None, **cfg: Any
) -> Path:
    """A random tiny model of ``model_type`` saved by transformers with the tokenizer of the GGUF
    ``vocab`` (SmolLM2's by default) as transformers reads it: config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    g = vocab or smollm2_path()
    tok = tf.AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    tok.save_pretrained(out)
    config_class = {
        "llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig,
        "gemma": tf.GemmaConfig, "gpt2": tf.GPT2Config,
    }  # fmt: skip
    shape = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    ) | cfg  # fmt: skip
    if model_type == "gemma":  # its head_dim defaults to 256, not hidden / heads
        shape.setdefault("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    if model_type == "gpt2":  # no GQA; its FFN width is n_inner
        del shape["num_key_value_heads"]
        shape["n_inner"] = shape.pop("intermediate_size")
    config = config_class[model_type](
        vocab_size=len(tok), tie_word_embeddings=tied, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, **shape,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    randomize(model)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf(tmp_path_factory.mktemp("tiny-llama"))


def _same_logits(gguf_path: Path, hf_dir: Path, bound: float) -> None:
    ref = tf.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    # the file's own tokenizer (AutoTokenizer would pick a class by model_type, and Qwen2's
    # rebuilds the pre-tokenizer from its own regex)
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    lm = load(str(gguf_path), "float32", "none")
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        assert lm._tok().encode(prompt) == ids, prompt  # the GGUF's tokenizer, as tokenizers'
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        got = all_logits(lm.model, torch.tensor(ids))
        assert (got - want).abs().max() <= bound * want.abs().max(), prompt


@pytest.mark.parametrize(
    ("model_type", "tied"),
    [
        ("llama", False), ("llama", True), ("qwen2", False), ("mistral", False),
        ("gemma", True), ("gpt2", True),
    ],
)  # fmt: skip
def test_hf_directory_to_gguf_runs_as_transformers(
    tmp_path: Path, model_type: str, tied: bool
) -> None:
    """llama: q/k rows permuted to adjacent pairs (the GGUF template's rope); qwen2: kept, with
    q/k/v biases; mistral: a llama GGUF, as llama.cpp's converter writes it (its window of
    4096 is wider than the 256 positions: nothing dropped); gemma: its norms' weights stored as
    1 + w (HF's w with rms_offset; randomize moved them off 0, so a missing 1 shows); tied: no
    output.weight. The GGUF needs no spec: its architecture names the template."""
    hf_dir = tiny_hf(tmp_path / "hf", model_type, tied)
    out = convert_checkpoint(hf_dir, tmp_path / "m.gguf", type_name="F32")
    _same_logits(out, hf_dir, 1e-4)
    r = gguf.GGUFReader(out)
    names = {t.name for t in r.tensors}
    assert ("output.weight" in names) is not tied
    arch = r.fields["general.architecture"].contents()
    assert arch == ("llama" if model_type == "mistral" else model_type)
    if model_type == "qwen2":
        assert {"blk.0.attn_q.bias", "blk.1.attn_v.bias"} <= names


def test_sentencepiece_tokenizer_to_gguf(tmp_path: Path) -> None:
    """A Gemma directory with Gemma-3's sentencepiece BPE tokenizer.json (byte fallback, '▁' for
    spaces, 262k tokens): the GGUF's 'llama' tokenizer encodes every prompt as tokenizers does,
    and its keys are llama.cpp's own Gemma-3 GGUF's: the same tokens and token types (but for
    the runs of spaces), no space prefix, and scores in the same order among merged tokens."""
    src = gemma3_path()
    hf_dir = tiny_hf(tmp_path / "hf", "gemma", True, vocab=src)
    out = convert_checkpoint(hf_dir, tmp_path / "m.gguf", type_name="F32")
    _same_logits(out, hf_dir, 1e-4)
    ours, theirs = gguf.GGUFReader(out).fields, gguf.GGUFReader(src).fields
    assert ours["tokenizer.ggml.model"].contents() == "llama"
    assert ours["tokenizer.ggml.add_space_prefix"].contents() is False
    tokens, original = ours["tokenizer.ggml.tokens"].contents(), theirs["tokenizer.ggml.tokens"]
    runs = {i for i, t in enumerate(original.contents()) if t and not t.strip(" ")}
    # llama.cpp's converter writes Gemma's 30 runs of spaces with spaces, as user-defined tokens;
    # the tokenizer.json has them as '▁' runs among the merged ones
    assert len(runs) == 30 and all(tokens[i] == "▁" * len(original.contents()[i]) for i in runs)
    assert [t for i, t in enumerate(tokens) if i not in runs] == [
        t for i, t in enumerate(original.contents()) if i not in runs
    ]
    types = ours["tokenizer.ggml.token_type"].contents()
    want = theirs["tokenizer.ggml.token_type"].contents()
    assert [t for i, t in enumerate(types) if i not in runs] == [
        t for i, t in enumerate(want) if i not in runs
    ]
    ours_s = np.asarray(ours["tokenizer.ggml.scores"].contents())
    theirs_s = np.asarray(theirs["tokenizer.ggml.scores"].contents())
    merged = (np.asarray(types) == 1) & (ours_s > -1e9)
    merged[list(runs)] = False
    assert merged.sum() > 200_000
    order = np.argsort(-theirs_s[merged], kind="stable")
    assert (np.diff(ours_s[merged][order]) <= 0).all()


def test_llama_permutation_matters(llama_dir: Path, tmp_path: Path) -> None:
    """Without the q/k permutation the GGUF's logits move (the test above cannot pass without
    it): the same weights written under llama.cpp's names but in HF's row order."""
    from inferflow.hf_gguf import _Rename

    out = tmp_path / "unpermuted.gguf"
    original = _Rename.__init__

    def no_permute(self: _Rename, gguf: str, permute_heads: int = 0, *rest: Any) -> None:
        original(self, gguf, 0, *rest)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Rename, "__init__", no_permute)
        convert_checkpoint(llama_dir, out, type_name="F32")
    with pytest.raises(AssertionError):
        _same_logits(out, llama_dir, 1e-4)


def _field(r: gguf.GGUFReader, key: str) -> tuple[list[int], Any]:
    f = r.fields[key]
    return [int(t) for t in f.types], f.contents()


def test_gguf_metadata_as_llama_cpp_reads_it(llama_dir: Path, tmp_path: Path) -> None:
    """Keys and value types as llama.cpp's loader checks them (counts UINT32, eps FLOAT32),
    the tokenizer as transformers has it, the chat template from chat_template.jinja."""
    out = convert_checkpoint(llama_dir, tmp_path / "m.gguf", type_name="Q8_0")
    r = gguf.GGUFReader(out)
    config = json.loads((llama_dir / "config.json").read_text())
    tok = tf.AutoTokenizer.from_pretrained(llama_dir)
    U32, F32, STR, ARR, BOOL = 4, 6, 8, 9, 7
    assert _field(r, "general.architecture") == ([STR], "llama")
    for key, value in (
        ("llama.block_count", config["num_hidden_layers"]),
        ("llama.embedding_length", config["hidden_size"]),
        ("llama.feed_forward_length", config["intermediate_size"]),
        ("llama.attention.head_count", config["num_attention_heads"]),
        ("llama.attention.head_count_kv", config["num_key_value_heads"]),
        ("llama.context_length", config["max_position_embeddings"]),
        ("llama.rope.dimension_count", config["hidden_size"] // config["num_attention_heads"]),
        ("tokenizer.ggml.bos_token_id", tok.bos_token_id),
        ("tokenizer.ggml.eos_token_id", tok.eos_token_id),
    ):
        assert _field(r, key) == ([U32], value), key
    types, eps = _field(r, "llama.attention.layer_norm_rms_epsilon")
    assert types == [F32] and eps == pytest.approx(config["rms_norm_eps"])
    assert _field(r, "llama.rope.freq_base")[0] == [F32]
    vocab = tok.get_vocab()
    tokens = _field(r, "tokenizer.ggml.tokens")[1]
    assert len(tokens) == len(vocab) and all(tokens[i] == t for t, i in vocab.items())
    assert _field(r, "tokenizer.ggml.model") == ([STR], "gpt2")
    assert _field(r, "tokenizer.ggml.pre") == ([STR], "gpt-2")  # ByteLevel's own regex
    assert _field(r, "tokenizer.ggml.add_bos_token") == ([BOOL], False)
    assert _field(r, "tokenizer.ggml.token_type")[0] == [ARR, 5]  # INT32
    assert _field(r, "tokenizer.chat_template")[1] == tok.chat_template
    assert len(_field(r, "tokenizer.ggml.merges")[1]) > 40_000
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"


def test_quantize_hf_directory_to_gguf(llama_dir: Path, tmp_path: Path) -> None:
    """`quantize` of an HF directory writes the same llama.cpp model, its weights quantized:
    Q8_0 stays within Q8_0's error of transformers' logits."""
    out = tmp_path / "q8.gguf"
    quantize_checkpoint(llama_dir, out, "Q8_0")
    _same_logits(out, llama_dir, 0.05)


def test_refuses_a_model_type_with_no_gguf_template(tmp_path: Path) -> None:
    """A model type with no llama.cpp template is named with the ones there are; nothing is
    written."""
    hf_dir = tiny_hf(tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(config | {"model_type": "falcon"}))
    with pytest.raises(
        CheckpointError, match=r"'falcon' has no llama.cpp GGUF template.*llama, mistral, qwen2"
    ):
        convert_checkpoint(hf_dir, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_a_window_llama_cpp_cannot_keep_is_printed_as_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Mistral with a window narrower than its context: llama.cpp's llama has no window, so the
    GGUF attends past it; convert says so (as llama.cpp's converter, it writes the file).
    Within the window the logits are transformers' still."""
    hf_dir = tiny_hf(tmp_path / "hf", "mistral", sliding_window=64)
    with caplog.at_level(logging.WARNING):
        out = convert_checkpoint(hf_dir, tmp_path / "m.gguf", type_name="F32")
    assert "dropped: sliding_window=64 (llama.cpp's llama has none" in caplog.text
    _same_logits(out, hf_dir, 1e-4)  # (the prompts are shorter than 64 tokens)


def test_prints_what_it_drops(
    llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tensor no template maps and a missing tokenizer are named, not silently lost."""
    import shutil

    from safetensors.torch import load_file, save_file

    hf_dir = tmp_path / "hf"
    shutil.copytree(llama_dir, hf_dir)
    (hf_dir / "tokenizer.json").unlink()
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["model.extra_scale"] = torch.ones(3)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    out = convert_checkpoint(hf_dir, tmp_path / "m.gguf", type_name="F32")
    dropped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dropped:")]
    assert any("tensor model.extra_scale" in d for d in dropped), dropped
    assert any("tokenizer.json not found" in d for d in dropped), dropped
    assert "tokenizer.ggml.tokens" not in gguf.GGUFReader(out).fields
