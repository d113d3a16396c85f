"""Write a synthetic llama-shaped GGUF (random weights) with the project's own GGUF writer, and
a spec that serves it by token ids: a large model for load-memory checks without a download.

    python tools/synthetic_gguf.py OUT_DIR [--size 1.5b|tiny] [--type Q4_0]

The weights are random blocks (codes uniform, every block's scale the same small number), so
outputs are meaningless but every kernel path runs as on a real checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inferflow.loaders.gguf_writer import GGUFTensorPlan, write_gguf  # noqa: E402
from inferflow.quant.formats import get_format  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int


# ~1.5B weights in Qwen2.5-1.5B's shape (llama layout, tied head); and a small one for tests
SHAPES = {
    "1.5b": Shape(hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, vocab=151936),
    "tiny": Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=1024),
}

SPEC = """\
# synthetic {size} llama-shaped GGUF (random {type} weights; tools/synthetic_gguf.py)
name: synthetic-{size}
source: {{format: gguf, files: [{file}]}}
tokenizer: {{from: none}}
network:
  type: decoder_only
  norm: rms
  activation: silu
  ffn: gated
  residual: pre_norm
  position: {{type: rope, pairing: adjacent}}
  output: {{tied: true}}
  tensors: {{preset: gguf}}
"""


def plans(s: Shape, qtype: str) -> list[GGUFTensorPlan]:
    kv = s.hidden // s.heads * s.kv_heads
    out = [GGUFTensorPlan("token_embd.weight", (s.vocab, s.hidden), qtype)]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [
            GGUFTensorPlan(b + "attn_norm.weight", (s.hidden,), "F32"),
            GGUFTensorPlan(b + "attn_q.weight", (s.hidden, s.hidden), qtype),
            GGUFTensorPlan(b + "attn_k.weight", (kv, s.hidden), qtype),
            GGUFTensorPlan(b + "attn_v.weight", (kv, s.hidden), qtype),
            GGUFTensorPlan(b + "attn_output.weight", (s.hidden, s.hidden), qtype),
            GGUFTensorPlan(b + "ffn_norm.weight", (s.hidden,), "F32"),
            GGUFTensorPlan(b + "ffn_gate.weight", (s.ffn, s.hidden), qtype),
            GGUFTensorPlan(b + "ffn_up.weight", (s.ffn, s.hidden), qtype),
            GGUFTensorPlan(b + "ffn_down.weight", (s.hidden, s.ffn), qtype),
        ]
    return out + [GGUFTensorPlan("output_norm.weight", (s.hidden,), "F32")]


def write(out_dir: Path, size: str = "1.5b", qtype: str = "Q4_0", seed: int = 0) -> Path:
    """Write ``synthetic-{size}.gguf`` and its spec into ``out_dir``; returns the spec's path."""
    s = SHAPES[size]
    fmt = get_format(qtype)
    if fmt.block_size != 32 or fmt.bytes_per_block != 18:
        raise SystemExit(
            f"--type: only Q4_0 (f16 scale + 16 bytes of nibbles) is written, not {qtype}"
        )
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.02], dtype=torch.float16).view(torch.uint8)

    def produce(p: GGUFTensorPlan) -> torch.Tensor:
        if p.type_name == "F32":
            return torch.ones(p.shape, dtype=torch.float32)
        blocks = torch.randint(0, 256, (p.nbytes // 18, 18), dtype=torch.uint8, generator=g)
        blocks[:, :2] = scale
        return blocks

    meta = {
        "general.architecture": "llama",
        "general.name": f"synthetic-{size}",
        "llama.vocab_size": s.vocab,
        "llama.embedding_length": s.hidden,
        "llama.block_count": s.layers,
        "llama.attention.head_count": s.heads,
        "llama.attention.head_count_kv": s.kv_heads,
        "llama.feed_forward_length": s.ffn,
        "llama.attention.layer_norm_rms_epsilon": 1e-6,
        "llama.rope.freq_base": 10000.0,
        "llama.context_length": 2048,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf = out_dir / f"synthetic-{size}.gguf"
    with open(gguf, "wb") as f:
        write_gguf(f, meta, plans(s, qtype), produce)
    spec = out_dir / f"synthetic-{size}.yaml"
    spec.write_text(SPEC.format(size=size, type=qtype, file=gguf.name))
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--size", choices=sorted(SHAPES), default="1.5b")
    ap.add_argument("--type", default="Q4_0")
    args = ap.parse_args()
    print(write(args.out_dir, args.size, args.type))


if __name__ == "__main__":
    main()
