"""Incremental detokenizing (`tokenizer.Detokenizer`) against decoding the whole output at every
token, on the tokenizers the engine serves: the bytes one (tiny-lm) and a byte-level BPE
`tokenizer.json` (the test Llama's), with multi-byte characters split across tokens."""

from __future__ import annotations

import random

import pytest

from services.executor.generation.tokenizer import ByteTokenizer, Detokenizer, Tokenizer, load_tokenizer
from tests.gen_models import build_llama

TEXTS = [
    "the quick brown fox",
    "héllo wörld, naïve café",
    "日本語のテキスト and 中文 mixed",
    "emoji 🎉🚂 at the end 👍",
    " leading space, then\nnew lines\n\n and\ttabs",
]


class WholeDecode:
    """What the engine did before: the whole output decoded again at every token."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.sent - len(stop)))
            if at >= 0:
                self.text = self.text[:at]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer("", build_llama(tmp_path_factory.mktemp("detok") / "llama"))


def sequences(tokenizer: Tokenizer, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    encoded = [tokenizer.encode(t) for t in TEXTS]
    noise = [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(200)]
    return [*encoded, *noise]


def check(tokenizer: Tokenizer, ids: list[int], stops: tuple[str, ...]) -> None:
    incremental, whole = Detokenizer(tokenizer, stops), WholeDecode(tokenizer, stops)
    pieces = []
    for i, token in enumerate(ids):
        incremental.add(token)
        whole.add(token)
        assert incremental.text == whole.text, (ids[: i + 1], incremental.text, whole.text)
        final = incremental.stopped or i == len(ids) - 1
        pieces.append(incremental.release(final))
        whole.sent = incremental.sent
        if incremental.stopped:
            break
    assert "".join(pieces) == incremental.text


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_incremental_text_equals_decoding_the_whole_output_at_every_token(kind: str, bpe: Tokenizer) -> None:
    tokenizer: Tokenizer = ByteTokenizer() if kind == "bytes" else bpe
    vocab = 256 if kind == "bytes" else 320
    split = [t for text in TEXTS for t in tokenizer.encode(text) if "\ufffd" in tokenizer.decode([t])]
    assert split, "no token holds part of a character: the multi-byte case is not exercised"
    for ids in sequences(tokenizer, vocab):
        check(tokenizer, ids, ())
        check(tokenizer, ids, ("ö", ", ", "🚂"))


def test_a_character_split_across_tokens_is_released_whole() -> None:
    tokenizer = ByteTokenizer()
    detok = Detokenizer(tokenizer, ())
    pieces = []
    for token in "a🎉b".encode():  # 🎉 is four bytes: four tokens
        detok.add(token)
        pieces.append(detok.release(final=False))
    assert pieces == ["a", "", "", "", "🎉", "b"]
    assert "".join(pieces) + detok.release(final=True) == "a🎉b"
