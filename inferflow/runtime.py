"""Load everything a spec names: network with weights, tokenizer. The Python entry point:

from inferflow.runtime import load
lm = load("smollm2-135m-instruct")
print(lm.complete("The capital of France is", SamplingParams(max_new_tokens=8)).text)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from inferflow.engine.generate import StepOutput, generate_tokens
from inferflow.engine.sampling import SamplingParams
from inferflow.errors import RequestError
from inferflow.model.build import load_model, parse_dtype
from inferflow.quant import get_format
from inferflow.spec import Spec, load_spec
from inferflow.spec.types import QuantSpec
from inferflow.tokenizer import Tokenizer, load_tokenizer


@dataclass
class Completion:
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    extra: dict[str, Any] = field(default_factory=dict)


def tokenizer_for(spec: Spec) -> Tokenizer | None:
    t = spec.tokenizer
    if t.kind == "none":
        return None
    metadata = None
    files = list(t.files)
    if t.kind == "gguf":
        from inferflow.loaders.gguf import read_gguf_metadata

        metadata = read_gguf_metadata(spec.source.files[0])
    overrides = {
        k: v
        for k, v in (("chat_template", t.chat_template), ("add_bos", t.add_bos))
        if v is not None
    }
    return load_tokenizer(t.kind, files, metadata, overrides)


@dataclass
class LanguageModel:
    spec: Spec
    model: nn.Module
    tokenizer: Tokenizer | None

    def encode_prompt(
        self, prompt: str, chat: bool = False, system: str | None = None
    ) -> list[int]:
        tok = self._tok()
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
            # the template writes BOS itself where the model wants one
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(prompt, add_special_tokens=True)

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError(f"spec {self.spec.name!r} declares no tokenizer: pass token ids")
        return self.tokenizer

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        eos = tuple(self.tokenizer.eos_ids) if self.tokenizer else ()
        if not eos and self.spec.hparams.eos_id is not None:
            eos = (self.spec.hparams.eos_id,)
        return generate_tokens(self.model, prompt_ids, params, eos)

    def complete(
        self, prompt: str | list[int], params: SamplingParams, chat: bool = False
    ) -> Completion:
        ids = list(prompt) if isinstance(prompt, list) else self.encode_prompt(prompt, chat)
        out, reason = [], None
        for step in self.stream(ids, params):
            out.append(step.token_id)
            reason = step.finish_reason
        shown = out[:-1] if reason == "stop" else out
        text = self.tokenizer.decode(shown) if self.tokenizer else ""
        return Completion(text, ids, out, reason)


def load(
    ref: str | Path | Spec, dtype: str | torch.dtype = "float32", quant: str | None = None
) -> LanguageModel:
    """``quant`` replaces the spec's default weight format: a format name re-quantizes every
    linear layer, "none" runs everything in float (the checkpoint's own quantized blocks too)."""
    spec = ref if isinstance(ref, Spec) else load_spec(ref)
    dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    q = None
    if quant == "none":
        q = QuantSpec(None, (), "dequantize")
    elif quant is not None:
        get_format(quant)  # an unknown name fails here, listing the known ones, before loading
        q = QuantSpec(quant, spec.quant.overrides)
    return LanguageModel(spec, load_model(spec, dt, q), tokenizer_for(spec))
