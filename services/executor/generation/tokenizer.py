"""Tokenizers for generation, and incremental detokenization for streamed text.

`bytes`: the UTF-8 bytes of the text are the token ids (0..255), for models without a
tokenizer of their own (the built-in `tiny-lm`); ids of 256 and over decode to nothing.
Otherwise a Hugging Face `tokenizer.json` (the `tokenizers` library; a directory holding one
may also carry `tokenizer_config.json` with a chat template).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from switchyard.errors import FailedPrecondition, InvalidArgument


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> str: ...


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The chat template for tokenizers without one: each message on a `role: content` line,
    then `assistant:` to answer."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode(errors="replace")

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return plain_chat_prompt(messages)


class HfTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FailedPrecondition(f"no tokenizer.json at {path}; set [generation] tokenizer to its path")
        self._tok = RustTokenizer.from_file(str(file))
        self._template = ""
        config = file.parent / "tokenizer_config.json"
        if config.is_file():
            self._template = str(json.loads(config.read_text()).get("chat_template") or "")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        if not self._template:
            return plain_chat_prompt(messages)
        import jinja2

        env = jinja2.Environment(autoescape=False)
        return env.from_string(self._template).render(messages=messages, add_generation_prompt=True)


def load_tokenizer(spec: str, model_dir: Path | None = None) -> Tokenizer:
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec) if spec else model_dir
    if path is None:
        raise FailedPrecondition("the model has no tokenizer; set [generation] tokenizer")
    if not path.is_absolute() and model_dir is not None:
        path = model_dir / path
    return HfTokenizer(path)


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """Chat messages as OpenAI sends them: [{"role": ..., "content": "..."}]."""
    if not isinstance(raw, list) or not raw:
        raise InvalidArgument("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidArgument(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": content})
    return out


class Detokenizer:
    """Text of a growing list of ids, released in pieces: text that may still change (an
    incomplete UTF-8 sequence, the start of a stop string) is held back until it cannot.

    Incremental, as vLLM detokenizes: each token decodes a window of the last ids, not the
    whole output again. `_done` is the text of `ids[:_read]`, which ends on a whole character;
    the new text is what decoding `ids[_prefix:]` adds to decoding `ids[_prefix:_read]` (the
    tokens before `_read` are context, so a decoder that treats a sequence's first token
    differently, such as a leading-space marker, gives the same text as decoding it all). A
    decoder whose output for earlier tokens changes with later ones is decoded whole."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (stop string cut off once found)
        self.sent = 0  # characters of `text` already released
        self.stopped = False
        self._done = ""
        self._prefix = 0
        self._read = 0
        self._before = ""  # the text of ids[_prefix:_read]

    def _decoded(self) -> str:
        """The text of all of `ids`, moving the window on at a whole character."""
        after = self._tokenizer.decode(self.ids[self._prefix :])
        if after.startswith(self._before):
            text = self._done + after[len(self._before) :]
        else:
            text = self._tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._done = text
            self._prefix, self._read = self._read, len(self.ids)
            self._before = self._tokenizer.decode(self.ids[self._prefix : self._read])
        return text

    def add(self, token: int) -> None:
        self.ids.append(token)
        self.text = self._decoded()
        for stop in self._stops:
            at = self.text.find(stop, max(0, self.sent - len(stop)))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True

    def release(self, final: bool) -> str:
        """The text safe to send now (all of it when `final`)."""
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):
                end -= 1  # an incomplete character: wait for its next bytes
            end = max(self.sent, end - self._hold) if not self.stopped else end
        piece = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return piece
