"""Blocks against independent references: transformers' rope scaling functions, BLOOM's ALiBi,
and sampling filters by their definitions."""

from __future__ import annotations

import pytest
import torch

from inferflow.blocks.position import POSITIONS, PositionArgs, RopeOptions, Rotary, alibi_slopes
from inferflow.engine import logits as L
from inferflow.engine.sampling import SamplingParams, make_sampler
from inferflow.errors import RequestError, SpecError

tf = pytest.importorskip("transformers")
from transformers import modeling_rope_utils as rope_utils  # noqa: E402

HEAD_DIM = 64


def _rotary(**opts) -> Rotary:
    return Rotary(PositionArgs(256, 4, HEAD_DIM, 4096, RopeOptions(**opts), theta=10000.0))


def _hf_config(scaling: dict) -> tf.LlamaConfig:
    return tf.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": 10000.0, **scaling},
    )


@pytest.mark.parametrize(
    "ours, hf, fn",
    [
        ({}, {"rope_type": "default"}, None),
        (
            {"type": "linear", "factor": 4.0},
            {"rope_type": "linear", "factor": 4.0},
            "_compute_linear_scaling_rope_parameters",
        ),
        (
            {
                "type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_positions": 512,
            },
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            },
            "_compute_llama3_parameters",
        ),
        (
            {"type": "yarn", "factor": 4.0, "original_max_positions": 1024},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
            "_compute_yarn_parameters",
        ),
    ],
)
def test_rope_frequencies_match_transformers(ours: dict, hf: dict, fn: str | None) -> None:
    rot = _rotary(scaling=ours or None)
    cfg = _hf_config(hf)
    if fn is None:
        expected = 1.0 / (
            10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM)
        )
        att = 1.0
    else:
        expected, att = getattr(rope_utils, fn)(cfg, "cpu")
    torch.testing.assert_close(rot.inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert rot.att_scale == pytest.approx(att)


def test_rope_pairings_are_permutations_of_each_other() -> None:
    """adjacent pairing on x equals half pairing on x with (2i, 2i+1) -> (i, i + d/2) permuted."""
    half, adj = _rotary(pairing="half"), _rotary(pairing="adjacent")
    x = torch.randn(5, 2, HEAD_DIM)
    pos = torch.arange(5)
    perm = torch.cat([torch.arange(0, HEAD_DIM, 2), torch.arange(1, HEAD_DIM, 2)])
    qa, _ = adj.rotate(x, x, pos)
    qh, _ = half.rotate(x[..., perm], x[..., perm], pos)
    torch.testing.assert_close(qa[..., perm], qh)


def test_partial_rotary_leaves_tail_untouched() -> None:
    rot = _rotary(partial=0.25)
    x = torch.randn(3, 2, HEAD_DIM)
    q, _ = rot.rotate(x, x, torch.tensor([5, 6, 7]))
    assert rot.rotary_dim == 16
    torch.testing.assert_close(q[..., 16:], x[..., 16:])
    assert not torch.allclose(q[..., :16], x[..., :16])


def test_rope_rejects_bad_pairing_and_dim() -> None:
    with pytest.raises(SpecError, match="pairing: 'zigzag' is not one of: half, adjacent"):
        _rotary(pairing="zigzag")
    with pytest.raises(SpecError, match="rotary dim 7 must be even"):
        _rotary(rotary_dim=7)


@pytest.mark.parametrize("name", [n for n, cls in POSITIONS.items() if cls.has_bias])
def test_group_bias_is_each_sequences_bias(name: str) -> None:
    """A decode group's bias in one op equals bias() of each sequence alone (one query)."""
    block = POSITIONS.get(name)(PositionArgs(32, 4, 8, 512, buckets=8, max_distance=64))
    for p in block.parameters():
        torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(0))
    q_pos = torch.tensor([3, 0, 200])
    # (B, S): keys on both sides of the query, all at it, distances in the log buckets and beyond
    k_pos = torch.stack(
        [torch.arange(5), torch.zeros(5, dtype=torch.long), torch.tensor([0, 100, 150, 190, 200])]
    )
    want = torch.stack([block.bias(q_pos[b : b + 1], k_pos[b]) for b in range(3)])  # type: ignore[misc]
    torch.testing.assert_close(block.group_bias(q_pos, k_pos), want)


@pytest.mark.parametrize("n_heads", [1, 4, 6, 8, 12, 16])
def test_alibi_slopes_match_bloom(n_heads: int) -> None:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    # BLOOM's tensor is slope * position for an all-ones mask: position 1 gives the slopes
    ref = build_alibi_tensor(torch.ones(1, 2), n_heads, torch.float32)[:, 0, 1]
    torch.testing.assert_close(alibi_slopes(n_heads), ref)


def test_top_k_and_top_p_filters() -> None:
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert torch.isfinite(L.top_k(logits, 2)).tolist() == [
        True,
        True,
        False,
        False,
        False,
    ]
    # nucleus 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed; 0.1 is not
    assert torch.isfinite(L.top_p(logits, 0.8)).tolist() == [
        True,
        True,
        True,
        False,
        False,
    ]
    # the top token always survives even with a tiny top_p
    assert torch.isfinite(L.top_p(logits, 0.01)).tolist() == [
        True,
        False,
        False,
        False,
        False,
    ]


def test_sampler_stays_in_nucleus_and_follows_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    sample = make_sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=0))
    draws = torch.tensor([sample(logits) for _ in range(4000)])
    counts = torch.bincount(draws, minlength=5).float() / len(draws)
    assert counts[3:].sum() == 0  # never outside the nucleus
    torch.testing.assert_close(counts[:3], torch.tensor([0.5, 0.2, 0.15]) / 0.85, atol=0.03, rtol=0)


def test_seed_reproducible_and_greedy() -> None:
    logits = torch.randn(100)
    a = make_sampler(SamplingParams(temperature=0.9, seed=7))
    b = make_sampler(SamplingParams(temperature=0.9, seed=7))
    assert [a(logits) for _ in range(20)] == [b(logits) for _ in range(20)]
    assert make_sampler(SamplingParams())(logits) == int(logits.argmax())


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_sampling_params_validation(kw: dict, msg: str) -> None:
    with pytest.raises(RequestError, match=msg):
        SamplingParams(**kw)


def test_norms_without_learned_parameters() -> None:
    """layer_plain and rms_plain hold no parameter and compute the plain formulas (written
    here in torch), in float32 whatever the activation dtype."""
    from inferflow.blocks import NORMS

    x = torch.randn(5, 32, dtype=torch.float64).float() * 3 + 1
    for name, want in (
        (
            "layer_plain",
            (x - x.mean(-1, keepdim=True))
            / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5),
        ),
        ("rms_plain", x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)),
    ):
        norm = NORMS.get(name)(32, 1e-5)
        assert not list(norm.parameters())
        torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-5)
        assert norm(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("in_place", [False, True])
def test_reverse_rope_rotates_by_minus_the_angle(in_place: bool) -> None:
    """``direction: reverse`` turns each pair (x1, x2) by -pos * theta^(-2j/D), computed here
    as a complex multiplication (the C kernel's in-place path and the torch path)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, HEAD_DIM, generator=g), torch.randn(5, 2, HEAD_DIM, generator=g)
    pos = torch.tensor([0, 3, 7, 100, 2000])
    freqs = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2).double() / HEAD_DIM)
    turn = torch.polar(torch.ones(5, HEAD_DIM // 2).double(), -pos[:, None].double() * freqs)

    def expected(x: torch.Tensor) -> torch.Tensor:
        half = HEAD_DIM // 2
        z = torch.complex(x[..., :half].double(), x[..., half:].double()) * turn[:, None]
        return torch.cat((z.real, z.imag), dim=-1).float()

    rope = _rotary(direction="reverse")
    if in_place:
        q2, k2 = q.clone(), k.clone()
        assert rope.rotate_(q2, k2, pos)
    else:
        q2, k2 = rope.rotate(q, k, pos)
    torch.testing.assert_close(q2, expected(q), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k2, expected(k), rtol=1e-4, atol=1e-4)
