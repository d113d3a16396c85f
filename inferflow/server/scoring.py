"""Classification and reranking routes (``/v1/classify`` in vLLM's shape, ``/v1/rerank`` in
Cohere's and vLLM's) for models with a classification head (``network.head``). Inputs go
through the batcher like embeddings: concurrent requests share forward passes."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from inferflow.engine.classify import (
    best_labels,
    classify_batch,
    classify_head,
    probabilities,
    token_classify_batch,
)
from inferflow.errors import RequestError
from inferflow.model.batch import check_inputs
from inferflow.runtime import LanguageModel
from inferflow.server.api_error import APIError
from inferflow.server.batcher import GroupCall
from inferflow.server.openapi import responses
from inferflow.server.protocol_aux import ClassifyBody, RerankBody
from inferflow.server.runner import EngineRunner, until_disconnect
from inferflow.server.state import ServerState, json_response


def add_scoring_routes(app: FastAPI, state: ServerState, auth: bool) -> None:
    def scoring(model: str | None) -> tuple[LanguageModel, EngineRunner, tuple[str, ...]]:
        lm, runner = state.ready(model)
        try:
            classify_head(lm.model)
        except RequestError as e:
            raise APIError(400, str(e), param="model") from None
        return lm, runner, lm.spec.hparams.labels

    def score(pairs: bool) -> GroupCall:
        # a pair's input is its ids followed by its token types (one list: the batcher's unit)
        def run(batch: list[list[int]], stop: Callable[[], bool]) -> Any:
            lm = state.lm
            assert lm is not None
            head = classify_head(lm.model)
            spans = head.spans()
            if head.per_token:  # each input's per-token probabilities
                return [
                    probabilities(x, spans).tolist() for x in token_classify_batch(lm.model, batch)
                ]
            if not pairs:
                return probabilities(classify_batch(lm.model, batch), spans).tolist()
            ids, types = [x[: len(x) // 2] for x in batch], [x[len(x) // 2 :] for x in batch]
            return probabilities(classify_batch(lm.model, ids, types), spans).tolist()

        return run

    @app.post("/v1/classify", responses=responses(auth, body=True, queued=True))
    async def classify(body: ClassifyBody, request: Request) -> Response:
        lm, runner, labels = scoring(body.model)
        inputs = await state.prompt_ids(body.input)
        h = lm.spec.hparams
        check_inputs(inputs, h.vocab_size, h.max_positions, "input")
        job = runner.batch(("classify",), inputs, score(False))
        probs = await until_disconnect(job, request.is_disconnected)
        head = classify_head(lm.model)
        spans = head.spans()
        data = []
        for i, p in enumerate(probs):
            if head.per_token:  # token_classify: a label (per group) and probabilities per token
                per = [best_labels(t, labels, spans) for t in p]
                tags = [b[0] if len(b) == 1 else b for b in per]
                row = {"token_ids": inputs[i], "labels": tags, "probs": p}
                data.append({"index": i, **row, "num_classes": len(labels)})
                continue
            best = best_labels(p, labels, spans)
            # a head of several independent choices: one label per group in "labels" too
            many = {"labels": best} if len(best) > 1 else {}
            data.append({"index": i, "label": best[0], **many, "probs": p, "num_classes": len(p)})
        used = sum(map(len, inputs))
        out = {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": state.name,
            "data": data,
            "usage": {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0},
        }
        return await json_response(out)

    @app.post("/v1/rerank", responses=responses(auth, body=True, queued=True))
    async def rerank(body: RerankBody, request: Request) -> Response:
        lm, runner, labels = scoring(body.model)
        if len(labels) != 1:
            raise APIError(
                400,
                f"model {state.name!r} has {len(labels)} labels: rerank needs a one-label "
                "head (a cross-encoder's relevance score); use /v1/classify",
                param="model",
            )
        docs = [d if isinstance(d, str) else d.text for d in body.documents]
        tok = state.tokenizer()
        enc = await asyncio.to_thread(lambda: [tok.encode_pair(body.query, d) for d in docs])
        h = lm.spec.hparams
        check_inputs([i for i, _ in enc], h.vocab_size, h.max_positions, "document")
        job = runner.batch(("rerank",), [i + t for i, t in enc], score(True))
        scores = [p[0] for p in await until_disconnect(job, request.is_disconnected)]
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[: body.top_n]
        results = [
            {"index": i, "relevance_score": scores[i]}
            | ({"document": {"text": docs[i]}} if body.return_documents else {})
            for i in order
        ]
        used = sum(len(i) for i, _ in enc)
        out = {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": state.name,
            "usage": {"total_tokens": used},
            "results": results,
        }
        return await json_response(out)
