"""The FastAPI application: OpenAI-compatible routes over one EngineRunner.

The port opens at once; the weights load in a background thread while ``/health`` answers 503
and the other routes say the model is loading. What a model serves follows its network type:
decoder-only models generate (completions, chat; embeddings if the spec declares them),
encoder-decoder models complete a source with its target (``inferflow.server.seq2seq``),
encoder-only models embed; every model tokenizes.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inferflow.engine.embed import embed_batch, resolve_pooling
from inferflow.model.batch import check_inputs
from inferflow.server.anthropic import add_anthropic_routes
from inferflow.server.api_error import APIError
from inferflow.server.echo import Echo, echoes
from inferflow.server.generation import Generation
from inferflow.server.guard import Guard, install_error_handlers
from inferflow.server.openapi import HEALTH, responses, trim_schema
from inferflow.server.protocol import CompletionBody, prompt_list
from inferflow.server.protocol_aux import DetokenizeBody, EmbeddingBody, TokenizeBody, TokenizeChat
from inferflow.server.protocol_chat import ChatBody
from inferflow.server.responses import add_responses_routes
from inferflow.server.runner import until_disconnect
from inferflow.server.scoring import add_scoring_routes
from inferflow.server.seq2seq import complete as seq2seq_complete
from inferflow.server.state import ServerConfig, ServerState, json_response

log = logging.getLogger(__name__)


def create_app(cfg: ServerConfig) -> FastAPI:
    state = ServerState(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        threading.Thread(
            target=state.load, args=(loop,), name="inferflow-load", daemon=True
        ).start()
        yield
        state.close()

    app = FastAPI(title="Inferflow", lifespan=lifespan)
    app.state.inferflow = state
    auth = bool(cfg.api_keys)
    trim_schema(app, auth)
    install_error_handlers(app)
    app.add_middleware(Guard, state=state)
    if cfg.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cfg.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )

    @app.get("/health", responses=HEALTH)
    async def health() -> JSONResponse:
        if state.load_error:
            return JSONResponse({"status": "failed", "error": state.load_error}, 500)
        if state.draining:
            return JSONResponse({"status": "draining"}, 503, headers={"Retry-After": "1"})
        if state.runner is None:
            return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse, responses=responses(auth, metrics=True))
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=responses(auth))
    async def models() -> dict[str, Any]:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": int(state.started),
                "owned_by": "inferflow",
                "root": state.name,  # (vLLM's: the model a name serves)
                "max_model_len": state.max_len(),
            }
            for name in state.names
        ]
        return {"object": "list", "data": cards}

    @app.post(
        "/v1/completions",
        response_model=None,
        responses=responses(auth, body=True, queued=True, sse=True),
    )
    async def completions(body: CompletionBody, request: Request) -> Any:
        lm, runner = state.generating(body.model, chat=False)
        prompts = await state.prompt_ids(body.prompt, body.add_special_tokens)
        if lm.spec.network.type == "encoder_decoder":
            head = {"model": state.name, "system_fingerprint": state.fingerprint}
            return await seq2seq_complete(lm, runner, head, body, prompts, request)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(
                400,
                "max_tokens: 0 generates nothing; it needs echo (to score the prompt)",
                param="max_tokens",
            )
        sent = prompt_list(body.prompt)

        async def echo() -> list[Echo]:
            texts = None
            if body.echo:
                tok = state.tokenizer()
                texts = [t if isinstance(t, str) else tok.decode(t) for t in sent]
            scored = body.logprobs if body.echo else None
            return await echoes(
                lm,
                runner,
                prompts,
                texts,
                scored,
                body.prompt_logprobs,
                request.is_disconnected,
                state.score_chunk(),
            )

        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        scored = body.echo or body.prompt_logprobs is not None
        gen = await state.start(
            lm, runner, prompts, body, max_tokens, body.logprobs, "prompt", echo if scored else None
        )
        return await _respond(gen, request, body.stream, body.stream_options)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=responses(auth, body=True, queued=True, sse=True),
    )
    async def chat(body: ChatBody, request: Request) -> Any:
        lm, runner = state.generating(body.model, chat=True)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        ids, plan = await state.chat_request_prompt(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        # echo (vLLM's): the reply starts with the last message's text when it has the reply's
        # role (a continued assistant message)
        last = body.messages[-1].as_template_input()
        shown = body.echo and last["role"] == body.reply_role(body.render().add_generation_prompt)

        async def echo() -> list[Echo]:
            texts = [last["content"]] if shown else None
            return await echoes(
                lm,
                runner,
                [ids],
                texts,
                None,
                body.prompt_logprobs,
                request.is_disconnected,
                state.score_chunk(),
            )

        scored = shown or body.prompt_logprobs is not None
        gen = await state.start(
            lm,
            runner,
            [ids],
            body,
            max_tokens,
            logprobs,
            "messages",
            echo if scored else None,
            tools=plan,
        )
        return await _respond(gen, request, body.stream, body.stream_options)

    @app.post("/v1/embeddings", responses=responses(auth, body=True, queued=True))
    async def embeddings(body: EmbeddingBody, request: Request) -> Response:
        lm, runner = state.ready(body.model)
        pooling, normalize = resolve_pooling(lm.spec)  # 400 where the spec declares none
        if pooling == "none":
            raise APIError(
                400,
                f"model {state.name!r} pools 'none' (a vector per token): /v1/embeddings "
                "returns one vector per input; use `inferflow embed` for per-token vectors",
                param="model",
            )
        dim = lm.spec.hparams.hidden
        if body.dimensions is not None and body.dimensions != dim:
            raise APIError(
                400,
                f"dimensions: this model's embeddings have {dim} dimensions, got {body.dimensions}",
                param="dimensions",
            )
        inputs = await state.prompt_ids(body.input)
        h = lm.spec.hparams
        check_inputs(inputs, h.vocab_size, h.max_positions, "input")

        def run(batch: list[list[int]], stop: Callable[[], bool]) -> Any:  # one pass: no stop
            vectors = embed_batch(lm.model, batch, pooling, normalize)
            assert isinstance(vectors, torch.Tensor)  # (pooling "none" was refused)
            return vectors.numpy()

        job = runner.batch(("embed", pooling, normalize), inputs, run)
        vectors = await until_disconnect(job, request.is_disconnected)
        data = []
        for i, vec in enumerate(vectors):
            value: Any = (
                vec.tolist()
                if body.encoding_format == "float"
                else base64.b64encode(vec.astype("<f4").tobytes()).decode()
            )
            data.append({"object": "embedding", "index": i, "embedding": value})
        used = sum(map(len, inputs))
        out = {
            "object": "list",
            "data": data,
            "model": state.name,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
        return await json_response(out)  # (up to 1024 vectors: not on the event loop)

    add_scoring_routes(app, state, auth)
    add_responses_routes(app, state, auth)
    add_anthropic_routes(app, state, auth)

    @app.post("/tokenize", responses=responses(auth, body=True))
    async def tokenize(body: TokenizeBody) -> Response:
        state.ready(body.model)
        if isinstance(body, TokenizeChat):
            listed = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
            messages = [m.as_template_input() for m in body.messages]
            ids = await state.chat_ids(messages, listed, body.render())
        else:
            texts = [body.prompt]
            ids = (
                await asyncio.to_thread(
                    state.tokenizer(source=True).encode_batch, texts, body.add_special_tokens
                )
            )[0]
        out = {"tokens": ids, "count": len(ids), "max_model_len": state.max_len()}
        return await json_response(out)

    @app.get("/tokenizer_info", responses=responses(auth))
    async def tokenizer_info() -> dict[str, Any]:
        """The tokenizer's special tokens and chat template, as vLLM's endpoint of that name
        answers (lm-evaluation-harness's ``tokenizer_backend=remote`` reads it, then tokenizes
        through /tokenize and /detokenize)."""
        state.ready()
        tok = state.tokenizer()
        return {
            "tokenizer_class": "inferflow",
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": None,
            "chat_template": tok.chat_template,
            "model_max_length": state.max_len(),
            "vocab_size": tok.vocab_size,
            "add_bos_token": tok.add_bos,
        }

    @app.post("/detokenize", responses=responses(auth, body=True))
    async def detokenize(body: DetokenizeBody) -> dict[str, Any]:
        lm, _ = state.ready(body.model)
        vocab, most = lm.spec.hparams.vocab_size, state.max_len()
        if len(body.tokens) > most:
            raise APIError(
                400,
                f"tokens: {len(body.tokens)} exceed the model's context, {most}",
                param="tokens",
            )
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"tokens: {bad[:5]} are outside the vocabulary 0..{vocab - 1}", param="tokens"
            )
        return {"prompt": await asyncio.to_thread(state.tokenizer().decode, body.tokens)}

    # every /v1 route also without the prefix (a client configured with a bare base URL), as
    # llama-server serves them; the schema lists each route once
    for route in list(app.routes):
        if isinstance(route, APIRoute) and route.path.startswith("/v1/"):
            app.add_api_route(
                route.path[3:],
                route.endpoint,
                methods=list(route.methods or ()),
                response_model=None,
                response_class=route.response_class,
                include_in_schema=False,
            )
    return app


async def _respond(gen: Generation, request: Request, stream: bool, options: Any) -> Any:
    if stream:
        usage = bool(options and options.include_usage)
        return StreamingResponse(
            gen.sse(usage), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    return await gen.response(request.is_disconnected)
