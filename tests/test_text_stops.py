"""StopMatcher: stop strings found across chunk boundaries, nothing after them shown."""

import random

import pytest

from llm_executorch_mlx.text import StopMatcher


def run(stops, chunks):
    """(everything emitted, whether it stopped) for a stream of chunks."""
    matcher = StopMatcher(stops)
    shown = []
    for chunk in chunks:
        emit, stopped = matcher.feed(chunk)
        shown.append(emit)
        if stopped:
            return "".join(shown), True
    return "".join(shown) + matcher.flush(), False


def reference(stops, text):
    """Cut at the stop string that completes first, at its start."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[: min(hits)[1]], True) if hits else (text, False)


def test_stop_inside_one_chunk():
    matcher = StopMatcher(["<|end|>"])
    assert matcher.feed("Hello<|end|> more") == ("Hello", True)
    assert matcher.feed("after") == ("", True)
    assert matcher.flush() == ""


def test_stop_split_across_chunks_is_held_then_dropped():
    matcher = StopMatcher(["<|end|>"])
    assert matcher.feed("Hello <|e") == ("Hello ", False)
    assert matcher.feed("nd") == ("", False)
    assert matcher.feed("|> tail") == ("", True)


def test_false_start_is_released():
    matcher = StopMatcher(["</answer>"])
    assert matcher.feed("a </ans") == ("a ", False)
    assert matcher.feed("wer but no") == ("</answer but no", False)
    assert matcher.feed(" <") == (" ", False)
    assert matcher.flush() == "<"


def test_no_stops_pass_through():
    matcher = StopMatcher()
    assert matcher.feed("anything <|end|>") == ("anything <|end|>", False)
    assert matcher.flush() == ""


def test_the_stop_completed_first_wins():
    # "bc" completes before "abcd" does, however the text is chunked.
    for chunks in (["abcd"], list("abcd"), ["a", "bcd"]):
        assert run(["abcd", "bc"], chunks) == ("a", True)
    assert run(["xyz", "yz!"], ["wxyz!"]) == ("w", True)


@pytest.mark.parametrize("seed", range(20))
def test_any_chunking_gives_the_reference_answer(seed):
    rng = random.Random(seed)
    stops = ["\n\nUser:", "###", "ab", "😀!"]
    alphabet = ["a", "b", "#", "\n", "User:", " ", "x", "😀", "!"]
    text = "".join(rng.choice(alphabet) for _ in range(40))
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 10)))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    assert run(stops, chunks) == reference(stops, text)
    assert run(stops, list(text)) == reference(stops, text)


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])
