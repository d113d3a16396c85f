"""Structured output: a request's grammar masks, at every step, the tokens that cannot come
next, so what it generates parses (a JSON Schema, a JSON object, a regex, a list of choices, a
Lark grammar).

The grammar engine is llguidance (Microsoft's, also behind llama.cpp's and vLLM's guided
decoding): one dependency-free wheel, a mask in tens of microseconds per step on CPU, JSON
Schema / regex / Lark compiled lazily (no up-front automaton over the vocabulary, so a new
schema costs milliseconds, not seconds), and errors returned as messages rather than
crashes. xgrammar, the other common choice, pulls a CUDA build of torch as a dependency.

``compile_grammar`` turns a request's constraint into llguidance's grammar text (a RequestError
naming what is wrong otherwise) as a ``Grammar``; the engine keeps one ``Constraint`` (a
matcher) per sample, copied from it.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from typing import Any

import torch

from inferflow.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it (", " and ": "), no other whitespace: a model cannot pad its
# output with newlines until max_tokens (llguidance's flexible whitespace allows that); a
# schema's "x-guidance" options may still change it
JSON_OPTIONS = {"whitespace_flexible": False}
_lock = threading.Lock()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a serve install has it
        raise RequestError(
            "structured output needs the llguidance package: pip install 'inferflow[serve]'"
        ) from None
    return llguidance


def lltokenizer(tok: Any, vocab: int) -> Any:
    """llguidance's view of ``tok`` (each id's bytes, the specials, the end tokens) for a
    model of ``vocab`` logits; built once per tokenizer (a second or so for 150k tokens)."""
    with _lock:
        cached = getattr(tok, "_llguidance", None)
        if cached is not None and cached[0] == vocab:
            return cached[1]
        llg = _llguidance()
        n = min(vocab, tok.vocab_size)

        class View:  # what llguidance.TokenizerWrapper reads
            eos_token_id = tok.eos_id
            bos_token_id = tok.bos_id
            tokens = [tok.token_to_bytes(i) for i in range(n)]
            special_token_ids = [i for i in range(n) if tok.is_special(i)]

            def __call__(self, text: str | bytes) -> list[int]:
                s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
                return tok.encode(s, add_special_tokens=False)

        ll = llg.LLTokenizer(
            llg.TokenizerWrapper(View()), n_vocab=vocab, eos_token=list(tok.eos_ids) or None
        )
        tok._llguidance = (vocab, ll)
        return ll


def compile_grammar(kind: str, value: Any, ll: Any) -> Grammar:
    """A constraint compiled: ``json_schema`` (a schema object), ``json_object`` (any JSON
    object), ``regex``, ``choice`` (one of a list of strings) or ``grammar`` (Lark). A
    constraint llguidance cannot compile is a RequestError with its message. Runs where the
    request arrives (the server: a worker thread), never on the engine's thread."""
    llg = _llguidance()
    m = llg.LLMatcher
    try:
        if kind in ("json_schema", "json_object"):
            schema = value if kind == "json_schema" else {"type": "object"}
            text = m.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        elif kind == "regex":
            text = m.grammar_from_regex(value)
        elif kind == "choice":
            text = m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
        elif kind == "grammar":
            text = m.grammar_from_lark(value)
        else:
            raise RequestError(f"unknown constraint {kind!r}; allowed: {', '.join(KINDS)}")
    except ValueError as e:
        raise RequestError(f"{kind}: {e}") from None
    proto = m(ll, text)  # (building it validates it: an error state, never an exception)
    if proto.is_error():
        raise RequestError(f"{kind}: cannot be compiled: {proto.get_error()}")
    return Grammar(proto, (ll.vocab_size + 31) // 32)


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled constraint: a matcher at the grammar's start that nothing advances. Each
    sample starts as its copy (microseconds), so admitting a request builds no grammar on the
    engine's thread (building one takes 1-10 ms)."""

    proto: Any  # llguidance.LLMatcher
    words: int  # 32-bit words of a mask

    def start(self) -> Constraint:
        return Constraint(self.proto.deep_copy(), self.words)


# llguidance's bitmask (little-endian 32-bit words) read as bytes has token t at bit t % 8 of
# byte t // 8
_POW2 = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


@functools.cache
def _executor() -> Any:
    return _llguidance().LLExecutor()


class Constraint:
    """One sample's place in its grammar: ``consume`` the token drawn, ``stopped`` once the
    grammar is complete and only an end token may follow; ``mask_rows`` masks the next
    token's logits of many samples at once."""

    def __init__(self, matcher: Any, words: int) -> None:
        self.matcher, self.words = matcher, words

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RequestError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def stopped(self) -> bool:
        return bool(self.matcher.is_stopped())


def mask_rows(x: torch.Tensor, rows: list[int], constraints: list[Constraint]) -> None:
    """Set to -inf, in place, every logit of ``x[rows[k]]`` that ``constraints[k]``'s grammar
    forbids next. The masks are computed together on llguidance's threads (it drops the GIL),
    then unpacked to the vocabulary with byte operations."""
    b, w = len(rows), constraints[0].words
    words = torch.zeros(b, w, dtype=torch.int32)
    _executor().unsafe_compute_mask_ptr(
        [(c.matcher, k) for k, c in enumerate(constraints)], words.data_ptr(), w * 4, b
    )
    n = min(x.shape[-1], 32 * w)
    banned = (words.view(torch.uint8).unsqueeze(-1) & _POW2).eq(0).reshape(b, -1)[:, :n]
    if rows == list(range(x.shape[0])):
        x[:, :n].masked_fill_(banned, float("-inf"))
        x[:, n:] = float("-inf")  # (logits past the grammar's vocabulary)
        return
    for k, j in enumerate(rows):
        x[j, :n].masked_fill_(banned[k], float("-inf"))
        x[j, n:] = float("-inf")
