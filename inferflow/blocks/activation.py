"""Activations by name. Gated variants (SwiGLU, GeGLU) are ``ffn: gated`` with one of these."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from inferflow.registry import Registry

Activation = Callable[[torch.Tensor], torch.Tensor]
ACTIVATIONS: Registry[Activation] = Registry("activation")

ACTIVATIONS.add("relu", F.relu)
ACTIVATIONS.add("silu", F.silu)
ACTIVATIONS.add("gelu", F.gelu)  # exact (erf)
ACTIVATIONS.add("tanh", torch.tanh)  # (BERT's pooler)
ACTIVATIONS.add(
    "gelu_tanh", lambda x: F.gelu(x, approximate="tanh")
)  # HF gelu_new / gelu_pytorch_tanh


def _gelu_quick(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS.add("gelu_quick", _gelu_quick)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


ACTIVATIONS.add("relu2", _relu2)
