"""The cross-attention bank (inferflow.model.cross): every query row attends over its own
source's memory, checked against softmax(q k^T / sqrt(d)) v computed per row by hand, on the
kernel path and the padded torch path; slots are reused, padding never leaks into a result, and
misuse is refused."""

from __future__ import annotations

import pytest
import torch

from inferflow.model.cross import CrossBank, CrossMemory

H, D, LAYERS = 4, 8, 2


def memory(n: int, seed: int) -> CrossMemory:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(H, n, D, generator=g), torch.randn(H, n, D, generator=g))
        for _ in range(LAYERS)
    ]


def by_hand(q: torch.Tensor, mem: CrossMemory, layer: int, scale: float) -> torch.Tensor:
    k, v = mem[layer]  # (H, S, D)
    w = torch.softmax(torch.einsum("hd,hsd->hs", q, k) * scale, dim=-1)
    return torch.einsum("hs,hsd->hd", w, v)


PATHS = ["kernel", "torch"]


@pytest.mark.parametrize("path", PATHS)
def test_rows_attend_over_their_own_source(path: str) -> None:
    mems = [memory(n, seed) for seed, n in enumerate([5, 17, 1, 9])]
    bank = CrossBank.of(mems)
    # sequences in any order, a slot read by rows far apart, one sequence of 3 tokens
    slots, lengths = [2, 0, 3, 0, 1, 2], [1, 1, 3, 1, 1, 1]
    rows = bank.rows(slots, lengths)
    if path == "torch":
        rows.kernel = None
    elif rows.kernel is None:
        pytest.skip("the C kernels are off or could not be built here")
    q = torch.randn(sum(lengths), H, D, generator=torch.Generator().manual_seed(9))
    per_row = [s for s, n in zip(slots, lengths, strict=True) for _ in range(n)]
    for layer in range(LAYERS):
        got = rows.attend(layer, q, 0.3)
        want = torch.stack([by_hand(q[i], mems[s], layer, 0.3) for i, s in enumerate(per_row)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_freed_slot_is_reused_and_its_old_positions_never_read() -> None:
    """A long source leaves, a short one takes its slot and its first block: its rows see the
    short memory only (attention stops at the new length), and the pool did not grow."""
    long, short, other = memory(20, 1), memory(3, 2), memory(7, 3)
    bank = CrossBank.of([long, other])
    pool = bank.k[0].shape[0]
    bank.remove(0)
    assert bank.add(short) == 0 and bank.k[0].shape[0] == pool
    q = torch.randn(2, H, D)
    for path in PATHS:
        rows = bank.rows([0, 1], [1, 1])
        if path == "torch":
            rows.kernel = None
        got = rows.attend(1, q, 0.5)
        torch.testing.assert_close(got[0], by_hand(q[0], short, 1, 0.5), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], by_hand(q[1], other, 1, 0.5), rtol=1e-5, atol=1e-5)


def test_a_source_takes_room_for_its_own_length() -> None:
    """Blocks of 16 positions: a 1-token source takes one, a 40-token source three (not the
    longest source's room for every slot); the bank grows as sources come and keeps them."""
    lengths = [1, 40, *(4 + i % 3 for i in range(9))]
    mems = [memory(n, i) for i, n in enumerate(lengths)]
    bank = CrossBank(LAYERS, H, D, torch.float32)
    slots = [bank.add(m) for m in mems]
    assert slots == list(range(len(mems)))
    assert [len(b) for b in bank.blocks[: len(mems)]] == [1, 3] + [1] * 9
    q = torch.randn(len(mems), H, D)
    got = bank.rows(slots, [1] * len(mems)).attend(0, q, 1.0)
    want = torch.stack([by_hand(q[i], m, 0, 1.0) for i, m in enumerate(mems)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_misuse_is_refused() -> None:
    bank = CrossBank.of([memory(4, 0), memory(6, 1)])
    with pytest.raises(ValueError, match="0 positions"):
        bank.add(memory(0, 2))
    bank.remove(1)
    with pytest.raises(ValueError, match="free cross-memory slot"):
        bank.rows([0, 1], [1, 1])
