"""Sampling parameters and the per-request sampler built once from them (mlx-lm's make_sampler).

``make_sampler(params, end_ids)`` returns a callable ``sampler(logits (V,), prompt, output) ->
token id``. Order: processors (repetition / presence / frequency penalties, logit bias, end
tokens banned below min_new_tokens) -> strategy:

- greedy (temperature 0): argmax;
- FSD (``fsd_alpha`` > 0; inferflow.engine.fsd), deterministic; with ``fsd_random_steps`` T, the
  first T tokens are sampled as below instead (randomized FSD);
- mirostat v1 / v2 (Basu et al.; llama.cpp's definitions: tau target surprise in bits, eta
  learning rate, mu starts at 2 tau; v1 estimates Zipf's exponent from the top 100 tokens);
- otherwise temperature, then top-k, top-p, min-p, typical, tail-free, then a draw.

``sample_batch`` draws a token for every row of a step at once: processors only on the rows that
have them, one argmax over the greedy rows, and temperature / top-k / top-p / min-p vectorized
over the plain sampling rows (inferflow.engine.batch_sampling); mirostat, FSD, typical and
tail-free rows run their own strategy. A sampler called alone is a batch of one, the same code.

Each request owns its torch.Generator (seeded) and a draw takes one uniform from it (inverse
CDF), so a seed gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from inferflow.engine import batch_sampling as B
from inferflow.engine import logits as L
from inferflow.engine.constrain import Grammar
from inferflow.engine.fsd import NGramAntiLM, fsd_choose
from inferflow.errors import RequestError

MAX_N = 64
# bounds on what one request may ask, so that no field can make a step's work unbounded
# (README "Security model"); limits tied to the model (context, vocabulary) are Engine.check's
MAX_FSD_N = 16  # FSD's n-gram order: each token counts n n-grams of up to n tokens
MAX_FSD_K = 100  # FSD's candidates, scored one by one
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 1000  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's bound)
MAX_LENGTH_PENALTY = 10.0  # |length_penalty|: a score divides by len ** length_penalty
MAX_REPETITION_PENALTY = 100.0
MAX_MIROSTAT_TAU = 64.0  # target surprise in bits (a vocabulary of 2**64 tokens)
MAX_MIROSTAT_ETA = 10.0
GREEDY, VECTOR, OWN = "greedy", "vector", "own"  # how a row is drawn (Sampler.kind)
# a seed is an int64 (sample i of n draws with seed + i, inside torch.Generator's range)
SEED_RANGE = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    tfs_z: float = 1.0
    mirostat: int = 0  # 0 off, 1 or 2
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    fsd_alpha: float = 0.0  # > 0 turns frustratingly simple decoding on
    fsd_k: int = 6
    fsd_n: int = 3
    fsd_random_steps: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (not shown in the text)
    # the text: the stop string (or stop token's text) that ended it kept at its end; special
    # tokens dropped, or kept and, with spaces_between_special_tokens, set apart from the text
    # around them by a space (HF's slow tokenizers; None: as the tokenizer decodes them)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n >= 0: chosen token's logprob plus the top n
    n: int = 1  # samples per prompt; they share the prompt's KV blocks (sample i uses seed + i)
    # structured output (inferflow.engine.constrain.compile_grammar)
    grammar: Grammar | None = None
    # > 1: beam search (inferflow.engine.beam) returning the n best beams; the processors
    # (penalties, bias, min_new_tokens) apply, temperature and the filters do not
    beam_width: int = 1
    length_penalty: float = 1.0  # beams rank by logprob / generated_len ** length_penalty
    # the prefix cache shares blocks only between requests of equal salts (vLLM's cache_salt;
    # the server adds the client's API key when it has several)
    cache_salt: str = ""

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> RequestError:
            return RequestError(f"{name}: must be {rule}, got {getattr(self, name)!r}")

        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a number >= 0")
        for name in ("top_k", "min_new_tokens", "fsd_random_steps"):
            if getattr(self, name) < 0:
                raise bad(name, ">= 0 (0 turns it off)")
        for name in ("top_p", "typical_p", "tfs_z"):
            if not 0 < getattr(self, name) <= 1:
                raise bad(name, "in (0, 1] (1 turns it off)")
        if not 0 <= self.min_p < 1:
            raise bad("min_p", "in [0, 1) (0 turns it off)")
        if self.mirostat not in (0, 1, 2):
            raise bad("mirostat", "one of 0 (off), 1, 2")
        for name, most in (("mirostat_tau", MAX_MIROSTAT_TAU), ("mirostat_eta", MAX_MIROSTAT_ETA)):
            if not 0 < getattr(self, name) <= most:  # (False for NaN)
                raise bad(name, f"in (0, {most}]")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            raise bad("length_penalty", f"in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]")
        if not 0 <= self.fsd_alpha < 1:
            raise bad("fsd_alpha", "in [0, 1) (0 turns FSD off)")
        if not 1 <= self.fsd_k <= MAX_FSD_K:
            raise bad("fsd_k", f"in [1, {MAX_FSD_K}]")
        if not 1 <= self.fsd_n <= MAX_FSD_N:
            raise bad("fsd_n", f"in [1, {MAX_FSD_N}]")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"in (0, {MAX_REPETITION_PENALTY}] (1 turns it off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "in [-2, 2]")
        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", ">= 1")
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})"
            )
        if self.grammar is not None and self.min_new_tokens:
            raise RequestError(
                f"min_tokens: {self.min_new_tokens} does not combine with structured output (a "
                "grammar ends the output once it is complete); leave min_tokens at 0",
                "min_tokens",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "in [0, 20]")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise bad("seed", f"an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"in [1, {MAX_N}]")
        if not 1 <= self.beam_width <= MAX_N:
            raise bad("beam_width", f"in [1, {MAX_N}] (1 turns beam search off)")
        if self.beam_width > 1:
            if self.n > self.beam_width:
                raise RequestError(f"n ({self.n}) exceeds beam_width ({self.beam_width})", "n")
            if self.stop or self.logprobs is not None or self.grammar is not None:
                raise RequestError(
                    "beam search does not take stop strings, logprobs or structured output",
                    "beam_width",
                )
        if any(not s for s in self.stop):
            raise RequestError("stop: stop strings must not be empty")
        if len(self.stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(
                f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(
                f"stop_token_ids: {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(
                f"logit_bias: {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}"
            )
        for tok, b in self.logit_bias.items():
            if not math.isfinite(b) or not -100 <= b <= 100:
                raise RequestError(
                    f"logit_bias: bias for token {tok} must be in [-100, 100], got {b}"
                )


class Sampler:
    """Built once per request; stateful where the strategy is (mirostat's mu, FSD's n-grams)."""

    def __init__(self, params: SamplingParams, end_ids: Sequence[int] = ()) -> None:
        p = self.params = params
        self.processors: list[L.Processor] = []
        if p.repetition_penalty != 1.0:
            self.processors.append(L.repetition_penalty(p.repetition_penalty))
        if p.presence_penalty or p.frequency_penalty:
            self.processors.append(
                L.presence_frequency_penalty(p.presence_penalty, p.frequency_penalty)
            )
        if p.logit_bias:
            self.processors.append(L.logit_bias(p.logit_bias))
        if p.min_new_tokens:
            banned = [*p.stop_token_ids, *(() if p.ignore_eos else end_ids)]
            self.processors.append(L.ban_until(banned, p.min_new_tokens))
        self.gen = torch.Generator()
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.gen.manual_seed(seed)
        self.mu = 2 * p.mirostat_tau
        self.anti = NGramAntiLM(p.fsd_n) if p.fsd_alpha > 0 else None

    def process(
        self, logits: torch.Tensor, prompt: Sequence[int] = (), output: Sequence[int] = ()
    ) -> torch.Tensor:
        """The processors alone (penalties, bias, end tokens banned below min_new_tokens), in
        float32 (beam search runs them on log-probabilities)."""
        x = logits.float()
        for proc in self.processors:
            x = proc(x, prompt, output)
        return x

    def __call__(
        self, logits: torch.Tensor, prompt: Sequence[int] = (), output: Sequence[int] = ()
    ) -> int:
        return sample_batch([self], logits.unsqueeze(0), [prompt], [output])[0]

    def kind(self, output: Sequence[int]) -> str:
        """How this step's token is drawn: GREEDY (argmax), VECTOR (temperature, top-k / top-p
        / min-p: vectorized across the batch) or OWN (FSD, mirostat, typical, tail-free:
        ``own``, one request at a time)."""
        p = self.params
        if self.anti is not None and len(output) >= p.fsd_random_steps:
            return OWN
        if p.temperature == 0:
            return GREEDY
        if p.mirostat or p.typical_p < 1 or p.tfs_z < 1:
            return OWN
        return VECTOR

    def own(self, x: torch.Tensor, prompt: Sequence[int], output: Sequence[int]) -> int:
        """The strategies drawn one request at a time, on processed finite logits (V,)."""
        p = self.params
        if self.anti is not None and len(output) >= p.fsd_random_steps:
            return fsd_choose(x, self.anti, [*prompt, *output], p.fsd_alpha, p.fsd_k)
        x = scaled(x, p.temperature)
        if p.mirostat:
            return self._mirostat(x)
        return self._draw(torch.softmax(truncate(x, p), dim=-1))

    def uniform(self) -> float:
        """The next draw's u in [0, 1), from this request's generator (53 random bits)."""
        return float(torch.rand((), generator=self.gen, dtype=torch.float64))

    def _draw(self, probs: torch.Tensor) -> int:
        """Inverse CDF over ``probs`` (V,), the rule of the vectorized rows."""
        c = B.cdf(probs.unsqueeze(0))
        u = torch.tensor([self.uniform()], dtype=torch.float64)
        return int(B.inverse_cdf(c, u)[0])

    def _mirostat(self, x: torch.Tensor) -> int:
        p = self.params
        probs, idx = torch.sort(torch.softmax(x, dim=-1), descending=True)
        if p.mirostat == 1:
            m = min(100, probs.numel() - 1)
            i = torch.arange(m - 1, dtype=torch.float64)
            t = torch.log((i + 2) / (i + 1))
            b = torch.log(probs[: m - 1].double() / probs[1:m].double())
            s_hat = float((t * b).sum() / (t * t).sum())
            eps = s_hat - 1
            n = probs.numel()
            k = ((eps * 2**self.mu) / (1 - n ** (-eps))) ** (1 / s_hat) if eps > 0 else n
            keep = min(max(int(k), 1), n) if math.isfinite(k) else n
        else:  # v2: drop tokens more surprising than mu
            keep = max(1, int((-torch.log2(probs) <= self.mu).sum()))
        kept = probs[:keep] / probs[:keep].sum()
        j = self._draw(kept)
        self.mu -= p.mirostat_eta * (-math.log2(float(kept[j])) - p.mirostat_tau)
        return int(idx[j])


def finite(x: torch.Tensor) -> torch.Tensor:
    """Logits an extreme (valid) penalty or temperature pushed past the float range: +inf
    becomes the largest float, so those tokens share the probability instead of making it NaN;
    a NaN logit is never drawn. -inf (a banned token) stays."""
    return torch.nan_to_num(x, nan=-math.inf, posinf=torch.finfo(x.dtype).max, neginf=-math.inf)


def scaled(x: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Logits (last dim) / temperature (a number, or a (B, 1) tensor: one per row), shifted
    first so the largest is 0: a tiny temperature sends the others to -inf (greedy in the limit)
    instead of overflowing to +inf and NaN. The shift changes no probability and no filter (all
    of them are shift-invariant)."""
    return scale_(finite(x), temperature)


def scale_(x: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``scaled`` in place, on logits already finite (a batch of them is megabytes per pass)."""
    # (0 / 0 at the largest when the temperature underflows the dtype: those stay at 0)
    return x.sub_(x.amax(-1, keepdim=True)).div_(temperature).nan_to_num_(nan=0.0)


def truncate(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The truncation filters in order, on logits already divided by the temperature."""
    x = L.min_p(L.top_p(L.top_k(x, p.top_k), p.top_p), p.min_p)
    return L.tail_free(L.typical(x, p.typical_p), p.tfs_z)


def make_sampler(params: SamplingParams, end_ids: Sequence[int] = ()) -> Sampler:
    return Sampler(params, end_ids)


def sample_batch(
    samplers: Sequence[Sampler],
    logits: torch.Tensor,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> list[int]:
    """One token per row of ``logits`` (B, V), row i drawn by ``samplers[i]`` after
    ``prompts[i]`` + ``outputs[i]``: exactly the token that sampler draws alone (each row uses
    only its own values and its own generator).

    What can fail on one request's input (its processors, its own strategy, a vectorized row
    with no token left to draw) runs before any vectorized row takes its uniform: a caller that
    retries row by row after an exception gets the same tokens for the greedy and vectorized
    rows (an own-strategy row drawn before the failing one has moved its generator on)."""
    x = finite(logits.float())  # (B, V), a new tensor: the rows below are written in place
    for i, s in enumerate(samplers):
        if s.processors:
            x[i] = finite(s.process(logits[i], prompts[i], outputs[i]))
    kinds = [s.kind(out) for s, out in zip(samplers, outputs, strict=True)]
    toks = [0] * len(samplers)
    greedy = [i for i, k in enumerate(kinds) if k == GREEDY]
    if greedy:
        for i, t in zip(greedy, B.argmax_rows(B.take_rows(x, greedy)), strict=True):
            toks[i] = t
    vec = [i for i, k in enumerate(kinds) if k == VECTOR]
    # (overwrites x when every row is vectorized: nothing reads x after that)
    dists = _distributions(B.take_rows(x, vec), [samplers[i].params for i in vec]) if vec else []
    for i, k in enumerate(kinds):
        if k == OWN:
            toks[i] = samplers[i].own(x[i], prompts[i], outputs[i])
    if vec:
        u = torch.tensor([samplers[i].uniform() for i in vec], dtype=torch.float64)
        for i, t in zip(vec, B.draw(dists, u), strict=True):
            toks[i] = t
    return toks


def _distributions(x: torch.Tensor, ps: list[SamplingParams]) -> list[B.Dist]:
    """The vectorized rows x (b, V), finite, overwritten: temperature, then top-k, top-p, min-p."""
    temp = torch.tensor([p.temperature for p in ps], dtype=x.dtype, device=x.device)
    z = scale_(x, temp.unsqueeze(1))
    return B.distributions(z, [p.top_k for p in ps], [p.top_p for p in ps], [p.min_p for p in ps])
