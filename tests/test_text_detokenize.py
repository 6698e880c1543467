"""StreamDecoder: streamed text equals one-shot decoding, with no half characters."""

import pytest
from test_text_tokenizer import (
    build_byte_bpe,
    build_byte_fallback_bpe,
    build_sentencepiece,
    build_tiktoken,
    build_unigram,
)

from llm_executorch_mlx.text import StreamDecoder, load_tokenizer

BUILDERS = {
    "byte_bpe": build_byte_bpe,
    "unigram": build_unigram,
    "byte_fallback": build_byte_fallback_bpe,
    "sentencepiece": build_sentencepiece,
    "tiktoken": build_tiktoken,
}
TEXTS = [
    "Hello world, the quick brown fox.",
    "Emoji 😀🎉👍🏽 then CJK 漢字かな交じり文, café ☕ and 🇯🇵.",
    "  spaced  out \n\n new lines\tand tabs 你好",
]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tokenizer(request, tmp_path_factory):
    return load_tokenizer(BUILDERS[request.param](tmp_path_factory.mktemp(request.param)))


def stream(decoder, ids):
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_one_shot_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces, tail = stream(StreamDecoder(tokenizer), ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)
    assert sum(bool(p) for p in pieces) > 1  # it streams, not one lump at the end


def test_incomplete_characters_are_held_back(tokenizer, request):
    ids = tokenizer.encode("a😀b漢")
    decoder = StreamDecoder(tokenizer)
    held = 0
    for count, token_id in enumerate(ids, 1):
        piece = decoder.push(token_id)
        assert "\ufffd" not in piece
        if tokenizer.decode(ids[:count]).endswith("\ufffd"):
            assert piece == ""
            held += 1
    # Unigram's vocabulary has whole characters, so nothing there is ever partial.
    assert held > 0 or request.node.callspec.params["tokenizer"] == "unigram"
    assert decoder.flush() == ""


def test_prefix_gives_the_first_piece_its_context(tokenizer):
    prompt, reply = tokenizer.encode("The quick brown"), tokenizer.encode(" fox jumps 😀")
    pieces, tail = stream(StreamDecoder(tokenizer, prefix_ids=prompt), reply)
    whole, shown = tokenizer.decode(prompt + reply), tokenizer.decode(prompt)
    assert "".join(pieces) + tail == whole[len(shown) :]


def test_flush_releases_an_incomplete_character(tmp_path):
    tok = load_tokenizer(build_byte_bpe(tmp_path))
    first_byte = tok.encode("😀")[0]
    decoder = StreamDecoder(tok)
    assert decoder.push(first_byte) == ""
    assert decoder.flush() == tok.decode([first_byte]) == "\ufffd"
    assert decoder.flush() == ""


def test_each_step_decodes_a_short_window(tmp_path):
    tok = load_tokenizer(build_byte_bpe(tmp_path))
    windows = []

    class Spy:
        def decode(self, ids):
            windows.append(len(ids))
            return tok.decode(ids)

    ids = tok.encode(" ".join(TEXTS) * 40)
    pieces, tail = stream(StreamDecoder(Spy()), ids)
    assert len(ids) > 1000
    assert "".join(pieces) + tail == tok.decode(ids)
    assert max(windows) <= 8  # never the whole history
