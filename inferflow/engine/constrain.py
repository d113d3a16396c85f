"""Structured output: a request's grammar masks, at every step, the tokens that cannot come
next, so what it generates parses (a JSON Schema, a JSON object, a regex, a list of choices, a
Lark grammar).

The grammar engine is llguidance (Microsoft's, also behind llama.cpp's and vLLM's guided
decoding): one dependency-free wheel, a mask in tens of microseconds per step on CPU, JSON
Schema / regex / Lark compiled lazily (no up-front automaton over the vocabulary, so a new
schema costs milliseconds, not seconds), and errors returned as messages rather than
crashes. xgrammar, the other common choice, pulls a CUDA build of torch as a dependency.

``compile_grammar`` turns a request's constraint, once within its bounds
(``inferflow.engine.grammar_bounds``), into llguidance's grammar text (a RequestError naming
what is wrong otherwise) as a ``Grammar``; the engine keeps one ``Constraint`` (a
matcher) per sample, copied from it.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from inferflow.engine.grammar_bounds import (
    KINDS,
    GrammarLimits,
    check_bounds,
    grammar_text,
    parser_limits,
    short,
)
from inferflow.errors import RequestError

__all__ = ["KINDS", "Constraint", "Grammar", "compile_grammar", "compile_text", "mask_rows"]

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


def compile_grammar(kind: str, value: Any, ll: Any, limits: GrammarLimits | None = None) -> Grammar:
    """A constraint compiled in this process: ``json_schema`` (a schema object),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of a list of strings) or
    ``grammar`` (Lark), within ``limits``. A constraint out of bounds or one llguidance
    cannot compile is a RequestError with its message. The server validates the constraint
    in a worker process first (``validated_text``) and builds it with ``compile_text``."""
    check_bounds(kind, value, limits or GrammarLimits())
    return compile_text(kind, grammar_text(kind, value), ll)


def compile_text(kind: str, text: str, ll: Any) -> Grammar:
    """llguidance's grammar ``text`` as a Grammar, checked at its first two steps: a grammar
    whose first mask fails, or whose first allowed token it then refuses, is a RequestError
    here (at admission) rather than a failed request in the engine. The matcher's own
    construction runs without the GIL."""
    llg = _llguidance()
    proto = llg.LLMatcher(ll, text, log_level=0, limits=parser_limits())
    words = (ll.vocab_size + 31) // 32
    if not proto.is_error():
        first = proto.deep_copy()
        mask = torch.zeros(1, words, dtype=torch.int32)
        _executor().unsafe_compute_mask_ptr([(first, 0)], mask.data_ptr(), words * 4, 1)
        allowed = (mask.view(torch.uint8).unsqueeze(-1) & _POW2).flatten().nonzero()
        # one allowed token taken, and the mask after it (a grammar may fail only then)
        if not first.is_error() and len(allowed) and first.consume_token(int(allowed[0])):
            _executor().unsafe_compute_mask_ptr([(first, 0)], mask.data_ptr(), words * 4, 1)
        if first.is_error():
            raise RequestError(f"{kind}: fails at its first steps: {short(first.get_error())}")
    if proto.is_error():
        raise RequestError(f"{kind}: cannot be compiled: {short(proto.get_error())}")
    return Grammar(proto, words)


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
            raise RequestError(
                f"the grammar refused token {token}: {short(self.matcher.get_error())}"
            )

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
    for c in constraints:  # (an error state masks every token: say why instead)
        if c.matcher.is_error():
            raise RequestError(f"the grammar failed: {short(c.matcher.get_error())}")
    n = min(x.shape[-1], 32 * w)
    banned = (words.view(torch.uint8).unsqueeze(-1) & _POW2).eq(0).reshape(b, -1)[:, :n]
    if rows == list(range(x.shape[0])):
        x[:, :n].masked_fill_(banned, float("-inf"))
        x[:, n:] = float("-inf")  # (logits past the grammar's vocabulary)
        return
    for k, j in enumerate(rows):
        x[j, :n].masked_fill_(banned[k], float("-inf"))
        x[j, n:] = float("-inf")
