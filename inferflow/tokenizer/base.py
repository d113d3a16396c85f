"""The engine's tokenizer: a ``tokenizers.Tokenizer`` plus the special-token facts a checkpoint states.

Every constructor (GGUF metadata, ``tokenizer.json``, ``vocab.txt``) builds a backend
``tokenizers.Tokenizer`` and hands it here with the ids it read; encoding, decoding and streaming
detokenization then work the same whatever the source.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

from inferflow.errors import TokenizerError

if TYPE_CHECKING:
    from inferflow.tokenizer.chat import TemplateBudget

logger = logging.getLogger(__name__)

# How a vocabulary entry spells its bytes, which ``token_to_piece`` needs and the backend's decoder
# hides (it decodes sequences, not single tokens in isolation).
PIECE_STYLES = ("byte_level", "sentencepiece", "wordpiece", "plain")

# Token texts that end a turn in the chat formats we know; llama.cpp (llama-vocab.cpp,
# ``special_eog_ids``) stops generation on the same list, whatever the file's eos id says.
EOG_TOKEN_TEXTS = (
    "<|eot_id|>",  # llama 3
    "<|eom_id|>",  # llama 3.1 tool calls
    "<|im_end|>",  # chatml (qwen, smollm)
    "<|end|>",  # phi-3
    "<end_of_turn>",  # gemma
    "<|endoftext|>",  # gpt-2 family document end
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<end_of_utterance>",
)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable spelling of the 256 byte values (``bytes_to_unicode``), inverted."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


BYTE_DECODER: dict[str, int] = _byte_decoder()
BYTE_ENCODER: dict[int, str] = {b: c for c, b in BYTE_DECODER.items()}


def wrapping_of(
    backend: BackendTokenizer, bos_id: int | None, eos_id: int | None
) -> tuple[bool, bool]:
    """(add_bos, add_eos) as the backend's post-processor does them, read off what it makes of
    empty text."""
    probe = list(backend.encode("", add_special_tokens=True).ids)
    add_bos = bos_id is not None and probe[:1] == [bos_id]
    return add_bos, eos_id is not None and len(probe) > int(add_bos) and probe[-1] == eos_id


def piece_style_of(backend: BackendTokenizer) -> str:
    """Which spelling the vocabulary uses, read off the decoder the json configures."""
    if backend.decoder is None:
        return "plain"
    state = json.loads(backend.decoder.__getstate__())
    kinds = {state["type"], *(d.get("type") for d in state.get("decoders", []))}
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"ByteFallback", "Metaspace"}:
        return "sentencepiece"
    if "WordPiece" in kinds:
        return "wordpiece"
    return "plain"


class Tokenizer:
    """Text <-> ids for one checkpoint, with its bos/eos facts and chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_id: int | None = None,
        eos_ids: Sequence[int] = (),
        pad_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        piece_style: str = "plain",
        keep_post_processor: bool = False,
    ) -> None:
        if piece_style not in PIECE_STYLES:
            raise TokenizerError(
                f"unknown piece style {piece_style!r}; known: {', '.join(PIECE_STYLES)}"
            )
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids: list[int] = list(dict.fromkeys(eos_ids))  # eos first, duplicates dropped
        self.pad_id = pad_id
        self.unk_id = unk_id
        self.chat_template = chat_template
        self.piece_style = piece_style
        self._add_bos = add_bos
        self._add_eos = add_eos
        # An engine never pads or truncates inside the tokenizer: batching is the scheduler's job.
        backend.no_padding()
        backend.no_truncation()
        self._special_ids = {
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        }
        self._own_post_processor = not keep_post_processor
        if not keep_post_processor:
            self._set_post_processor()

    # -- special tokens --

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @add_bos.setter
    def add_bos(self, value: bool) -> None:
        self._add_bos = bool(value)
        self._set_post_processor()

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    @add_eos.setter
    def add_eos(self, value: bool) -> None:
        self._add_eos = bool(value)
        self._set_post_processor()

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.backend.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.backend.id_to_token(self.eos_id)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def _set_post_processor(self) -> None:
        """BOS/EOS go in through the backend's post-processor, as transformers does, so
        ``backend.encode`` and ``encode`` agree; a flag without its token is a checkpoint error."""
        self._own_post_processor = True
        if self._add_bos and self.bos_id is None:
            raise TokenizerError(
                "add_bos is set but the tokenizer has no bos token; name one with "
                "tokenizer.specials.bos"
            )
        if self._add_eos and self.eos_id is None:
            raise TokenizerError(
                "add_eos is set but the tokenizer has no eos token; name one with "
                "tokenizer.specials.eos"
            )
        specials: list[tuple[str, int]] = []
        single = "$A:0"
        pair_b = "$B:1"
        if self._add_bos and self.bos_id is not None:
            bos = str(self.backend.id_to_token(self.bos_id))
            specials.append((bos, self.bos_id))
            single, pair_b = f"{bos}:0 {single}", f"{bos}:1 {pair_b}"
        if self._add_eos and self.eos_id is not None:
            eos = str(self.backend.id_to_token(self.eos_id))
            specials.append((eos, self.eos_id))
            single, pair_b = f"{single} {eos}:0", f"{pair_b} {eos}:1"
        self.backend.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {pair_b}", special_tokens=specials
        )

    def set_specials(
        self,
        texts: Sequence[str],
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        pad_id: int | None,
        unk_id: int | None,
    ) -> None:
        """Name the special tokens (``texts`` become atomic in text and skipped in decoding) and
        the ids playing bos / eos / pad / unk; the bos/eos wrapping follows the new ids."""
        self.backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in texts]
        )
        self._special_ids = {
            i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special
        }
        self.bos_id, self.eos_ids = bos_id, list(dict.fromkeys(eos_ids))
        self.pad_id, self.unk_id = pad_id, unk_id
        if self._own_post_processor:
            self._set_post_processor()

    def set_template(
        self, single: str, pair: str | None, specials: Sequence[tuple[str, int]]
    ) -> None:
        """A post-processing template (``[CLS] $A [SEP]``); add_bos / add_eos then report whether
        it opens with bos / closes with eos."""
        try:
            self.backend.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=list(specials)
            )
        except Exception as e:  # tokenizers raises a bare Exception on a malformed template
            raise TokenizerError(f"template {single!r}: {e}") from None
        self._add_bos, self._add_eos = wrapping_of(self.backend, self.bos_id, self.eos_id)
        self._own_post_processor = False

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # -- text <-> ids --

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A text pair as one input (the tokenizer's pair template: [CLS] a [SEP] b [SEP] for
        BERT): (ids, each token's type: 0 for the first text, 1 for the second where the
        template says so)."""
        enc = self.backend.encode(first, second)
        return list(enc.ids), list(enc.type_ids)

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        encs = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encs]

    def decode(
        self,
        ids: Iterable[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool | None = None,
    ) -> str:
        """``spaces_between_special_tokens`` (with special tokens kept): True sets each special
        token apart from the text around it by a space, as HF's slow tokenizers join their
        pieces; False or None: as the tokenizer decodes them (fast tokenizers: no spaces)."""
        ids = list(ids)
        if skip_special_tokens or not spaces_between_special_tokens:
            return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))
        pieces: list[str] = []
        run: list[int] = []
        for t in ids:
            if self.is_special(t):
                if run:
                    pieces.append(str(self.backend.decode(run, skip_special_tokens=False)))
                pieces.append(str(self.backend.decode([t], skip_special_tokens=False)))
                run = []
            else:
                run.append(t)
        if run:
            pieces.append(str(self.backend.decode(run, skip_special_tokens=False)))
        return " ".join(pieces)

    def incremental_decoder(
        self, skip_special_tokens: bool = True, spaces_between_special_tokens: bool | None = None
    ) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens, spaces_between_special_tokens)

    def token_to_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own (llama.cpp's ``token_to_piece``): special
        tokens verbatim, byte tokens as their byte, '▁' as a space. A piece may be part of a
        multi-byte character, which is why this returns bytes."""
        tok = self.backend.id_to_token(token_id)
        if tok is None:
            raise TokenizerError(f"token id {token_id} out of range [0, {self.vocab_size})")
        if token_id in self._special_ids:
            return tok.encode("utf-8")
        if self.piece_style == "byte_level":
            try:
                return bytes(BYTE_DECODER[c] for c in tok)
            except KeyError:  # an added token kept in plain text (e.g. '<think>' with a space)
                return tok.encode("utf-8")
        if self.piece_style == "sentencepiece":
            if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                return bytes([int(tok[3:5], 16)])
            return tok.replace("▁", " ").encode("utf-8")
        if self.piece_style == "wordpiece":
            return (tok[2:] if tok.startswith("##") else " " + tok).encode("utf-8")
        return tok.encode("utf-8")

    def token_to_piece(self, token_id: int) -> str:
        """``token_to_bytes`` as text; an incomplete UTF-8 sequence shows as U+FFFD."""
        return self.token_to_bytes(token_id).decode("utf-8", errors="replace")

    # -- chat --

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        budget: TemplateBudget | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt for ``messages``; a server passes a ``budget`` (see ``render_chat_template``)
        because the template comes with the checkpoint. ``continue_final_message``: the prompt
        ends with the last message's text, open for the model to continue (transformers'
        option of that name: what the template prints after that text is cut)."""
        from inferflow.tokenizer.chat import cut_at_tag, render_chat_template, tag_final_message

        if continue_final_message and add_generation_prompt:
            raise TokenizerError(
                "continue_final_message continues the last message; it does not combine with "
                "add_generation_prompt (which starts a new one)"
            )

        if self.chat_template is None:
            raise TokenizerError(
                "this tokenizer has no chat template; set one with the 'chat_template' override"
            )
        specials = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": None if self.pad_id is None else self.backend.id_to_token(self.pad_id),
            "unk_token": None if self.unk_id is None else self.backend.id_to_token(self.unk_id),
        }
        if continue_final_message:
            messages = tag_final_message(messages)
        text = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            budget=budget,
            **{**specials, **kwargs},
        )
        return cut_at_tag(text) if continue_final_message else text

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids}, "
            f"add_bos={self.add_bos}, add_eos={self.add_eos}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )


class IncrementalDecoder:
    """Streaming detokenization: ``push`` one id, get the text it completes.

    Decoding a token alone is wrong for byte tokens (half a character), byte-level BPE pieces and
    sentencepiece's dropped leading space, so each step decodes a short window that starts at a
    token boundary already emitted (the prefix) and returns only what the new tokens add. Text
    ending in U+FFFD waits for the bytes that complete it. The pieces, plus ``flush()``, concatenate
    to ``tokenizer.decode(all_ids)`` (the vLLM / TGI ``prefix_offset``/``read_offset`` scheme).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces = spaces_between_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: a token boundary where all earlier text is emitted
        self._read = 0  # tokens before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens, self.spaces)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete byte sequence at the end, as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        self._prefix, self._read = self._read, len(self.ids)
        return new_text[len(prefix_text) :]
