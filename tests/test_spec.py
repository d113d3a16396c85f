"""Spec language: validation errors name the YAML path, the bad value and the allowed values;
hyperparameters come from the checkpoint and can be overridden; file references resolve."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from inferflow.blocks import NORMS
from inferflow.errors import SpecError
from inferflow.spec import BUILTIN_DIR, builtin_specs, load_spec, read_doc
from tests.conftest import gemma3_path, smollm2_path


def _smol_doc() -> dict:
    return read_doc(BUILTIN_DIR / "smollm2-135m-instruct.yaml")  # its base merged in


def test_builtin_specs_listed() -> None:
    assert {"smollm2-135m-instruct", "gemma-3-270m"} <= set(builtin_specs())


def test_smollm2_hparams_from_gguf_metadata() -> None:
    smollm2_path()
    spec = load_spec("smollm2-135m-instruct")
    h = spec.hparams
    # values from ASSETS.md / the GGUF header
    assert (h.hidden, h.n_layers, h.n_heads, h.n_kv_heads, h.vocab_size) == (576, 30, 9, 3, 49152)
    assert (h.head_dim, h.ffn_hidden, h.rope_theta, h.max_positions) == (64, 1536, 100000.0, 8192)
    assert h.attention_kind == "GQA"
    assert spec.source.files[0].name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_gemma3_hparams() -> None:
    gemma3_path()
    h = load_spec("gemma-3-270m").hparams
    assert (h.hidden, h.n_heads, h.n_kv_heads, h.head_dim, h.sliding_window) == (
        640,
        4,
        1,
        256,
        512,
    )
    assert h.attention_kind == "MQA" and h.vocab_size == 262144


def test_hparam_override(write_spec) -> None:
    smollm2_path()
    doc = _smol_doc() | {"hparams": {"rope_theta": 5000.0, "max_positions": 1024}}
    doc["source"]["files"] = [str(smollm2_path())]
    h = load_spec(write_spec(doc)).hparams
    assert h.rope_theta == 5000.0 and h.max_positions == 1024 and h.hidden == 576


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (
            lambda d: d["network"].update(norm="rmsnorm"),
            "network.norm: 'rmsnorm' is not one of: layer, layer_nobias, layer_plain, rms, rms_offset, rms_plain",
        ),
        (
            lambda d: d["network"].update(nrom="rms"),
            "network: unknown key 'nrom'; allowed: activation, attention",
        ),
        (
            lambda d: d["network"]["position"].update(type="rotary"),
            "network.position.type: 'rotary' is not one of: alibi, learned, none, relative, rope, sinusoidal",
        ),
        (
            lambda d: d["network"]["position"].update(pairing="interleaved"),
            "network.position.pairing: 'interleaved' is not one of: adjacent, half",
        ),
        (
            lambda d: d["network"].update(ffn_bias="yes"),
            "network.ffn_bias: 'yes' is not of type boolean",
        ),
        (
            lambda d: d["source"].update(format="onnx"),
            "source.format: 'onnx' is not one of: gguf, hf, inferflow_quant, pickle, safetensors",
        ),
        (lambda d: d["source"].pop("files"), "source: missing required key 'files'"),
        (
            lambda d: d["generation"].update(temperature=-1),
            "generation.temperature: -1 is less than the minimum of 0",
        ),
        (
            lambda d: (
                d["hparams"].update(hidden="big")
                if "hparams" in d
                else d.update(hparams={"hidden": "big"})
            ),
            "hparams.hidden: 'big' is not of type integer",
        ),
        (
            lambda d: d["network"]["tensors"].update(preset="hf_llamma"),
            "network.tensors.preset: 'hf_llamma' is not one of: gguf, hf_llama",
        ),
    ],
)
def test_schema_errors_name_path_value_and_allowed(mutate, expected: str, write_spec) -> None:
    doc = _smol_doc()
    mutate(doc)
    with pytest.raises(SpecError) as e:
        load_spec(write_spec(doc))
    assert expected in str(e.value)


def test_all_errors_reported_at_once(write_spec) -> None:
    doc = _smol_doc()
    doc["network"]["norm"] = "bad1"
    doc["network"]["activation"] = "bad2"
    with pytest.raises(SpecError) as e:
        load_spec(write_spec(doc))
    assert "network.norm: 'bad1'" in str(e.value) and "network.activation: 'bad2'" in str(e.value)


def test_schema_allowed_values_come_from_registries(write_spec) -> None:
    doc = _smol_doc()
    doc["network"]["norm"] = "my_norm_for_test"
    with pytest.raises(SpecError, match="my_norm_for_test"):
        load_spec(write_spec(doc))
    NORMS.add("my_norm_for_test", NORMS.get("rms"))
    try:
        smollm2_path()
        load_spec(write_spec(doc))  # a registered block needs no schema edit
    finally:
        NORMS._items.pop("my_norm_for_test")


def test_missing_file_names_ref_and_path(write_spec, tmp_path: Path) -> None:
    doc = _smol_doc()
    doc["source"]["files"] = ["weights/missing.gguf"]
    with pytest.raises(SpecError) as e:
        load_spec(write_spec(doc))
    assert "'weights/missing.gguf'" in str(e.value) and str(
        tmp_path / "weights/missing.gguf"
    ) in str(e.value)


def test_package_ref_of_missing_package(write_spec) -> None:
    doc = _smol_doc()
    doc["source"]["files"] = ["package://no_such_pkg_xyz/model.gguf"]
    with pytest.raises(SpecError, match="python package 'no_such_pkg_xyz' .* is not installed"):
        load_spec(write_spec(doc))


def test_relative_and_absolute_refs(write_spec, tmp_path: Path) -> None:
    src = smollm2_path()
    (tmp_path / "m").mkdir()
    link = tmp_path / "m" / "model.gguf"
    link.symlink_to(src)
    doc = _smol_doc()
    doc["source"]["files"] = ["m/model.gguf"]
    assert load_spec(write_spec(doc)).source.files[0] == link
    doc["source"]["files"] = [str(link)]
    assert load_spec(write_spec(doc)).source.files[0] == link


def test_yaml_syntax_error_has_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nnetwork: {type: decoder_only\n")
    with pytest.raises(SpecError, match="not valid YAML at line"):
        load_spec(p)


def test_not_a_mapping(tmp_path: Path) -> None:
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="must be a YAML mapping"):
        load_spec(p)


def test_unknown_spec_name_lists_builtins() -> None:
    with pytest.raises(SpecError, match="built-in: .*smollm2-135m-instruct"):
        load_spec("no-such-model")


def test_base_cycle(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("name: a\nbase: b\n")
    (tmp_path / "b.yaml").write_text("name: b\nbase: a\n")
    with pytest.raises(SpecError, match="cycle"):
        load_spec(tmp_path / "a.yaml")


def test_yaml_is_never_executed(tmp_path: Path) -> None:
    p = tmp_path / "evil.yaml"
    p.write_text("name: !!python/object/apply:os.system ['touch PWNED']\n")
    with pytest.raises(SpecError):
        load_spec(p)
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


def test_duplicate_yaml_keys_are_an_error(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys silently; a spec refuses them, at any depth,
    naming the key and both lines (YAML merge keys may still be overridden)."""
    p = tmp_path / "dup.yaml"
    p.write_text("name: a\nnetwork:\n  norm: rms\n  type: decoder_only\n  norm: layer\n")
    with pytest.raises(
        SpecError, match=r"line 5, .*duplicate key 'norm' \(first given at line 3\)"
    ):
        load_spec(p)
    p.write_text("name: a\nname: b\n")
    with pytest.raises(SpecError, match="duplicate key 'name'"):
        load_spec(p)
    p.write_text("name: a\nnetwork: {norm: rms, type: decoder_only, norm: layer}\n")  # one line
    with pytest.raises(SpecError, match=r"duplicate key 'norm' \(first given at line 2\)"):
        load_spec(p)
    merged = tmp_path / "merge.yaml"  # an anchor merged in, then one key overridden: allowed
    merged.write_text("x: &d {a: 1, b: 2}\ny: {<<: *d, b: 3}\n")
    from inferflow.spec import read_doc

    assert read_doc(merged)["y"] == {"a": 1, "b": 3}


def test_null_removes_what_the_base_spec_gives(tmp_path: Path) -> None:
    """A child spec removes an inherited map entry or setting by giving it null."""
    src = smollm2_path()
    base = _smol_doc()
    base["source"]["files"] = [str(src)]
    base["network"]["tensors"]["map"] = {"token_embd.weight": "dec.tok_embed.weight"}
    base["hparams"] = {"norm_eps": 1e-3}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\nname: child\nhparams: {norm_eps: null}\n")
    spec = load_spec(child)
    assert [e.source for e in spec.network.tensors.map] == ["token_embd.weight"]
    assert spec.hparams.norm_eps == pytest.approx(1e-5)  # the GGUF's own value again
    child.write_text(
        "base: base.yaml\nname: child\nnetwork: {tensors: {map: {token_embd.weight: null}}}\n"
    )
    spec = load_spec(child)
    assert spec.network.tensors.map == () and spec.hparams.norm_eps == pytest.approx(1e-3)


def test_readme_block_options_table_is_generated() -> None:
    """README.md's block options table is what tools/spec_options.py makes from the blocks'
    options classes (a new option or block shows up there without a README edit by hand)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "tools" / "spec_options.py"
    spec = importlib.util.spec_from_file_location("spec_options", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--check"]) == 0
    assert "| `network.ffn` | `moe` | `routing` | `softmax_topk` |" in mod.table()


def test_a_child_that_changes_a_block_type_replaces_its_options(write_spec) -> None:
    """``base: arch/llama`` gives ``position: {type: rope, pairing: half}``: a child's
    ``{type: learned, offset: 2}`` replaces it (pairing belongs to rope), while a child's
    ``{pairing: adjacent}`` merges into the base's rope."""
    from inferflow.blocks.position import LearnedOptions, RopeOptions

    doc = _smol_doc()
    doc["base"] = "arch/llama"
    del doc["network"]
    doc["network"] = {"position": {"type": "learned", "offset": 2}}
    ((name, opts),) = load_spec(write_spec(doc)).network.positions
    assert name == "learned" and opts == LearnedOptions(offset=2)
    doc["network"] = {"position": {"pairing": "adjacent"}}
    ((name, opts),) = load_spec(write_spec(doc, "b.yaml")).network.positions
    assert name == "rope" and opts == RopeOptions(pairing="adjacent")
