"""The server's configuration and state: the model (loaded in a background thread), its
engine runner, and the checks every generating route shares before it queues a request
(``ServerState.start``: sampling bounds, structured output, the context, echo)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi.responses import Response

from inferflow import __version__
from inferflow.engine.constrain import lltokenizer
from inferflow.engine.engine import Engine, EngineConfig
from inferflow.engine.grammar_bounds import GrammarLimits
from inferflow.errors import RequestError, context_exceeded
from inferflow.model.batch import check_input
from inferflow.model.materialise import peak_rss
from inferflow.runtime import LanguageModel, load
from inferflow.server.api_error import CLIENT_KEY, APIError
from inferflow.server.compiler import GrammarCompiler
from inferflow.server.echo import Echo
from inferflow.server.generation import Generation
from inferflow.server.limits import MAX_SCORED, SCORE_CHUNK
from inferflow.server.metrics import Metrics
from inferflow.server.protocol import GenerationBody, prompt_list
from inferflow.server.protocol_chat import ChatBody, ChatRender, NamedToolChoice
from inferflow.server.runner import EngineRunner
from inferflow.server.store import StoreLimits
from inferflow.server.tools import ToolPlan, plan_tools
from inferflow.spec import Spec
from inferflow.tokenizer import Tokenizer
from inferflow.tokenizer.chat import TemplateBudget

log = logging.getLogger(__name__)

NEW_TURN = ChatRender()  # (chat's default: an assistant turn opened after the messages)

# what the networks the engine does not run serve (neither chats; encoder-only: no completions)
SERVES = {
    "encoder_only": "/v1/embeddings, /v1/classify and /v1/rerank (with a classification head), "
    "/tokenize and /detokenize",
    "encoder_decoder": "/v1/completions (source text in, target text out), /tokenize and "
    "/detokenize (it has no chat template)",
}


def system_fingerprint(cfg: ServerConfig) -> str:
    """OpenAI's ``system_fingerprint``: stable while the served model and engine stay the same —
    a hash of the engine version, the resolved spec, the checkpoint files (names, sizes,
    modification times), the dtype and the quantization."""
    files = [
        (str(f), *((st.st_size, st.st_mtime_ns) if (st := _stat(f)) else ()))
        for f in cfg.spec.source.files
    ]
    text = json.dumps(
        [__version__, cfg.spec.raw, files, cfg.dtype, cfg.quant], sort_keys=True, default=str
    )
    return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:12]


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


@dataclass
class ServerConfig:
    spec: Spec
    # the model ids clients may send (default: the spec's name); responses report the first
    served_names: tuple[str, ...] = ()
    dtype: str = "float32"
    quant: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    api_keys: tuple[str, ...] = ()  # any of them; with several, each key's prompts cache apart
    max_body_bytes: int = 4 << 20
    cors_origins: tuple[str, ...] = ()
    # SIGTERM: running requests may finish for this long, then end with finish reason "abort"
    shutdown_grace: float = 10.0
    template: TemplateBudget = field(default_factory=TemplateBudget)  # chat template limits
    url: str | None = None  # where it listens (said once requests can be served)
    responses: StoreLimits = field(default_factory=StoreLimits)  # kept for previous_response_id
    draft: Spec | None = None  # speculative method "draft": the draft model
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # structured-output bounds
    # echo / prompt_logprobs: prompt tokens one request may have scored (None: MAX_SCORED, or
    # the context where that is longer), and the positions scored between two engine steps
    max_scored_tokens: int | None = None
    score_chunk: int = SCORE_CHUNK
    tool_call_parser: str | None = None  # a CALL_FORMATS name (None: from the chat template)


class ServerState:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.names = cfg.served_names or (cfg.spec.name,)
        self.name = self.names[0]
        self.metrics = Metrics()
        self.lm: LanguageModel | None = None
        self.runner: EngineRunner | None = None
        self.load_error: str | None = None
        self.started = time.time()
        self.draining = False  # SIGTERM: new requests get 503 while running ones finish
        self.closed = False  # close() ran: a load still under way starts nothing
        self.life = threading.Lock()  # (load's start and close, one at a time)
        self.active = 0  # HTTP requests in flight (but /health and /metrics)
        self.fingerprint = system_fingerprint(cfg)
        self.compiler = GrammarCompiler(cfg.grammar)

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            t0 = time.perf_counter()
            src = self.cfg.spec.source
            size = sum(f.stat().st_size for f in src.files if f.is_file())
            files = ", ".join(str(f) for f in src.files)
            log.info("loading %s: %s (%s, %.0f MiB)", self.name, files, src.format, size / 2**20)
            lm = load(self.cfg.spec, self.cfg.dtype, self.cfg.quant)
            decoder = lm.spec.network.type == "decoder_only"
            engine = None
            if decoder:
                cfg = self.cfg
                draft = None if cfg.draft is None else load(cfg.draft, cfg.dtype, cfg.quant).model
                engine = Engine(lm.model, lm.tokenizer, cfg.engine, draft)
            runner = EngineRunner(engine, self.metrics, self.cfg.engine.scheduler.max_waiting)
            with self.life:
                if self.closed:
                    log.info("the server stopped while %s loaded: not started", self.name)
                    return
                # what was loaded lives as long as the server: out of the garbage collector's
                # way, so that a full collection while serving walks only what requests made
                # (SmolLM2's server: ~230k objects, ~130 ms a full collection holding the
                # GIL); close() unfreezes them
                gc.collect()
                gc.freeze()
                runner.start(loop)
                self.lm, self.runner = lm, runner
            peak = peak_rss() / 2**20
            log.info(
                "model %s loaded in %.1f s (peak RSS %.0f MiB)%s",
                self.name,
                time.perf_counter() - t0,
                peak,
                f"; ready on {self.cfg.url}" if self.cfg.url else "",
            )
        except Exception as e:
            log.exception("loading %s failed", self.name)
            self.load_error = str(e)

    def close(self) -> None:
        """At shutdown: the engine stopped (its requests aborted) and what load froze back in
        the garbage collector's generations; a load still under way starts nothing."""
        with self.life:
            self.closed = True
            if self.runner is not None:
                self.runner.stop()
                gc.unfreeze()

    def ready(self, model: str | None = None) -> tuple[LanguageModel, EngineRunner]:
        if self.lm is None or self.runner is None:
            if self.load_error:
                raise APIError(500, f"the model failed to load: {self.load_error}", "server_error")
            raise APIError(
                503,
                "the model is still loading; retry shortly",
                "server_error",
                headers={"Retry-After": "1"},
            )
        if model is not None and model not in self.names:
            raise APIError(
                404,
                f"model {model!r} is not served here; available: "
                f"{', '.join(map(repr, self.names))}",
                param="model",
                code="model_not_found",
            )
        return self.lm, self.runner

    def max_len(self) -> int:
        """Tokens a sequence may hold: the engine's (the KV cache may hold less than the
        context), else the network's positions."""
        lm, runner = self.ready()
        return int(runner.engine.max_len if runner.engine else lm.spec.hparams.max_positions)

    def max_scored_tokens(self) -> int:
        cap = self.cfg.max_scored_tokens
        return cap if cap is not None else max(MAX_SCORED, self.max_len())

    def score_chunk(self) -> int:
        """Prompt positions scored between two engine steps: at most a step's token budget."""
        return min(self.cfg.score_chunk, self.cfg.engine.scheduler.max_batched_tokens)

    def generating(self, model: str | None, chat: bool) -> tuple[LanguageModel, EngineRunner]:
        """The model and its runner, for a completions (``chat``: chat) request; 400 for a
        network type that does not serve it."""
        lm, runner = self.ready(model)
        kind = lm.spec.network.type
        serves = SERVES.get(kind)
        if serves is not None and (chat or kind == "encoder_only"):
            what = "chat completions" if chat else "completions"
            raise APIError(
                400, f"model {self.name!r} is {kind}: it serves {serves}, not {what}", param="model"
            )
        return lm, runner

    async def start(
        self,
        lm: LanguageModel,
        runner: EngineRunner,
        prompts: list[list[int]],
        body: GenerationBody,
        max_tokens: int | None,
        logprobs: int | None,
        field: str,
        echo: Callable[[], Awaitable[list[Echo]]] | None = None,
        tools: ToolPlan | None = None,
    ) -> Generation:
        """Check and queue a generation request (chat and responses when ``field``, the request
        field holding the prompt, is messages or input). ``max_tokens`` unset: the spec's
        ``max_new_tokens``, at most what the context leaves; set past what the context leaves
        after the prompt: 400 naming both numbers, as vLLM answers; 0: nothing generated (only
        with ``echo``, completions' prompt scoring, which runs once every check has passed).
        ``tools``: chat_prompt's plan (its call markup, and its grammar when a call is
        required)."""
        most, longest = self.max_len(), max(map(len, prompts))
        limit = max_tokens or max(1, min(most - longest, lm.spec.generation.max_new_tokens))
        if max_tokens == 0:
            limit = 1  # (the parameters are checked; no request is queued)
        if longest > most - (max_tokens != 0):  # (and a position for the first new token)
            too_long = context_exceeded(most, longest, what=field)
            too_long.param = field
            raise too_long
        if max_tokens != 0 and longest + limit > most:
            why = context_exceeded(most, longest, limit, what=field)
            raise APIError(
                400,
                f"{why} ({body.MAX_FIELD} {limit}: at most {most - longest} new tokens fit "
                "after this prompt.)",
                param=body.MAX_FIELD,
                code=why.code,
            )
        params = body.sampling(
            limit, logprobs, lm.spec.hparams.vocab_size, most, lm.spec.generation
        )
        asked, constraint = body.constraint(), tools.forced if tools is not None else None
        if constraint is not None and asked is not None:
            raise APIError(
                400, f"{asked[0]}: does not combine with {constraint[0]}", param=asked[0]
            )
        if (c := constraint or asked) is not None:  # structured output: compiled off the loop
            name, kind, value = c
            tok, vocab = self.tokenizer(), lm.spec.hparams.vocab_size
            try:
                grammar = await self.compiler.compile(kind, value, lambda: lltokenizer(tok, vocab))
            except RequestError as e:
                raise APIError(400, f"{name}: {e}", param=name) from None
            try:
                params = dataclasses.replace(params, grammar=grammar)
            except RequestError as e:  # (a field that does not combine with a grammar)
                raise APIError(400, str(e), param=e.param) from None
        key = CLIENT_KEY.get()  # (several API keys: each key's prompts apart in the cache)
        salt = body.cache_salt or ""
        if key is not None or salt:
            params = dataclasses.replace(params, cache_salt=f"{key}\x00{salt}")
        chat = field != "prompt"
        echoes = None
        if echo is not None:  # (the scoring pass reads the prompts: check them first)
            for ids in prompts:
                check_input(ids, lm.spec.hparams.vocab_size, most - (max_tokens != 0), field)
            scored, cap = sum(map(len, prompts)), self.max_scored_tokens()
            if scored > cap:
                raise APIError(
                    400,
                    f"{field}: echo / prompt_logprobs would score {scored} prompt tokens; the "
                    f"limit is {cap} per request (--max-scored-tokens): send fewer prompts",
                    param=field,
                )
            echoes = await echo()
        try:
            return Generation(
                runner,
                lm.tokenizer,
                self.name,
                chat,
                prompts,
                params,
                self.fingerprint,
                echoes,
                generate=max_tokens != 0,
                tools=tools.parser if tools is not None else None,
                request_id=body.request_id,
                token_ids=bool(body.return_token_ids),
            )
        except RequestError as e:
            if e.param == "prompt":
                e.param = field
            raise

    async def chat_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None = None,
        render: ChatRender = NEW_TURN,
    ) -> list[int]:
        """Messages (``{role, content}``) through the chat template (with ``tools``: OpenAI
        tool objects, as transformers passes them; ``render``: the request's template
        switches), as token ids; in worker threads (the template renders under the server's
        budget)."""
        tok = self.tokenizer()
        text = await asyncio.to_thread(
            tok.apply_chat_template,
            messages,
            add_generation_prompt=render.add_generation_prompt,
            budget=self.cfg.template,
            continue_final_message=render.continue_final_message,
            **{**render.variables, "tools": tools},
        )  # (a TokenizerError, the template's or the messages': the request's 400)
        # (the template writes BOS where needed)
        return (await asyncio.to_thread(tok.encode_batch, [text], render.add_special_tokens))[0]

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        choice: str | None,
        named: str | None,
        parallel: bool,
        render: ChatRender = NEW_TURN,
    ) -> tuple[list[int], ToolPlan]:
        """A chat request's prompt (chat completions, responses) and how its tools run
        (``plan_tools``: the arguments are its own)."""
        template, fmt = self.tokenizer().chat_template, self.cfg.tool_call_parser
        plan = plan_tools(template, tools, choice, named, parallel, fmt)
        return await self.chat_ids(messages, plan.listed, render), plan

    async def chat_request_prompt(self, body: ChatBody) -> tuple[list[int], ToolPlan]:
        """``chat_prompt`` of a chat request (chat completions, the Messages API)."""
        choice = body.tool_choice
        return await self.chat_prompt(
            [m.as_template_input() for m in body.messages],
            [t.model_dump(exclude_none=True) for t in body.tools or []],
            choice if isinstance(choice, str) else None,
            choice.function.name if isinstance(choice, NamedToolChoice) else None,
            body.parallel_tool_calls,
            body.render(),
        )

    # Tokenizing and rendering templates run in worker threads, never on the event loop: the
    # tokenizer's encode_batch releases the GIL (its encode holds it, starving the loop), and
    # templates render in a worker process with a budget.

    async def prompt_ids(
        self,
        prompt: str | list[str] | list[int] | list[list[int]],
        add_special_tokens: bool = True,
    ) -> list[list[int]]:
        """A prompt or input field (any of OpenAI's four shapes) as token-id lists."""
        prompts = prompt_list(prompt)
        texts = [p for p in prompts if isinstance(p, str)]
        if not texts:
            return prompts  # type: ignore[return-value]
        tok = self.tokenizer(source=True)
        encoded = iter(await asyncio.to_thread(tok.encode_batch, texts, add_special_tokens))
        return [p if isinstance(p, list) else next(encoded) for p in prompts]

    def tokenizer(self, source: bool = False) -> Tokenizer:
        """The model's tokenizer; ``source``: what encodes input text (an encoder-decoder's
        source side, where its spec gives two)."""
        lm = self.lm
        tok = None if lm is None else lm.input_tokenizer if source else lm.tokenizer
        if tok is None:
            raise APIError(400, f"model {self.name!r} has no tokenizer: send token ids")
        return tok


async def json_response(obj: Any) -> Response:
    """A JSON response encoded in a worker thread (a large one would hold the event loop)."""
    body = await asyncio.to_thread(json.dumps, obj, ensure_ascii=False, separators=(",", ":"))
    return Response(body, media_type="application/json")
