"""Built-in specs on real GGUF files: teacher-forced fp32 logits against transformers (which loads
the same GGUF, dequantized) and greedy tokens against transformers' greedy generation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inferflow.engine.generate import generate_tokens
from inferflow.engine.sampling import SamplingParams
from inferflow.model.batch import FlatBatch
from inferflow.runtime import LanguageModel, load
from tests.conftest import gemma3_path, qwen_coder_path, smollm2_path

tf = pytest.importorskip("transformers")
pytest.importorskip("gguf")

TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the "
    "wick, polished the great lens, and watched the ships slip past the rocks. One winter night "
    "a storm rolled in from the north, and the light began to flicker. He lit a lantern, wrapped "
    "his coat around him and carried the flame up to the gallery, where the wind tore at his "
    "sleeves and the sea roared below like an animal waiting for its supper."
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
MODELS = {
    "smollm2-135m-instruct": smollm2_path,
    "gemma-3-270m": gemma3_path,
    "qwen2.5-coder-0.5b-instruct": qwen_coder_path,
}


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request: pytest.FixtureRequest) -> tuple[LanguageModel, torch.nn.Module]:
    path: Path = MODELS[request.param]()
    ours = load(request.param, "float32", "none")  # float reference mode: no bf16 kernels
    ref = tf.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return ours, ref.eval()


@pytest.mark.slow
def test_teacher_forced_logits_match(pair) -> None:
    ours, ref = pair
    ids = ours.tokenizer.encode(TEXT)[:64]
    assert len(ids) == 64
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
        from inferflow.engine.generate import new_cache

        batch = FlatBatch.single(torch.tensor(ids), 0, new_cache(ours.model, 64))
        batch.logits_rows = torch.arange(64)
        got = ours.model(batch)
    diff = (got - expected).abs().amax(-1)  # per position
    assert float(diff.max()) <= 1e-3, f"max abs logit difference per position: {diff.max():.2e}"


@pytest.mark.slow
def test_prompt_ids_match_transformers_tokenizer(pair) -> None:
    """Our tokenizer built from the GGUF metadata encodes as transformers' tokenizer built from
    the same GGUF (chat markup and code included)."""
    ours, _ = pair
    path = MODELS[ours.spec.name]()
    ref = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [*PROMPTS, TEXT, "<|im_start|>user\nhi<|im_end|>\n", "  x = [1,2]  # ünïcode\n\t"]
    for text in texts:
        want = ref(text, add_special_tokens=ours.tokenizer.add_bos)["input_ids"]
        assert ours.tokenizer.encode(text) == want, text


@pytest.mark.slow
def test_greedy_tokens_match(pair) -> None:
    ours, ref = pair
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        with torch.no_grad():
            hf = ref.generate(
                torch.tensor([ids]),
                max_new_tokens=16,
                do_sample=False,
                min_new_tokens=16,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        got = [
            s.token_id
            for s in generate_tokens(
                ours.model, ids, SamplingParams(max_new_tokens=16, ignore_eos=True)
            )
        ]
        assert got == hf, f"{prompt!r}: ours {got} vs transformers {hf}"


@pytest.mark.slow
def test_chat_generation_is_coherent(pair) -> None:
    ours, _ = pair
    if ours.tokenizer.chat_template is None:
        pytest.skip(f"{ours.spec.name} ships no chat template")
    out = ours.complete(
        "What is the capital of France? Answer in one word.",
        SamplingParams(max_new_tokens=12),
        chat=True,
    )
    assert "Paris" in out.text, out.text
