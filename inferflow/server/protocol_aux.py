"""The request bodies of the routes that do not generate: embeddings, classification and
reranking, tokenize and detokenize (the generating routes' are in ``protocol``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from inferflow.server.protocol import MAX_MESSAGES, MAX_PROMPTS, Body, Name, Prompt, Text
from inferflow.server.protocol_chat import Message, TemplateSwitches, Tool


class EmbeddingBody(Body):
    input: Prompt
    model: Name | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Name | None = None


class ClassifyBody(Body):
    """vLLM's classify request: texts (or token ids) in, label probabilities out."""

    input: Prompt
    model: Name | None = None
    user: Name | None = None


class RerankDocument(Body):
    text: Text


class RerankBody(Body):
    """The rerank request of Cohere / Jina / vLLM: documents scored against a query by a
    cross-encoder, best first."""

    query: Text
    documents: Annotated[list[Text | RerankDocument], Field(min_length=1, max_length=MAX_PROMPTS)]
    model: Name | None = None
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = True
    user: Name | None = None


class TokenizeText(Body):
    model: Name | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChat(TemplateSwitches):
    model: Name | None = None
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None  # rendered as chat does


def _tokenize_form(body: Any) -> str:
    return "TokenizeChat" if isinstance(body, dict) and "messages" in body else "TokenizeText"


# exactly one of prompt, messages (the tags are the class names, which no field is called)
TokenizeBody = Annotated[
    Annotated[TokenizeText, Tag("TokenizeText")] | Annotated[TokenizeChat, Tag("TokenizeChat")],
    Discriminator(_tokenize_form),
]


class DetokenizeBody(Body):
    model: Name | None = None
    tokens: list[int]
