"""Stop strings: matched across piece boundaries, never shown, earliest match wins."""

from __future__ import annotations

import random

from minisgl.tokenizer.stop import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[str, str | None, str]:
    """Feed the pieces; return (shown text, matched stop, text held at the end)."""
    m = StopMatcher(stops)
    shown = ""
    for p in pieces:
        r = m.feed(p)
        shown += r.text
        if r.matched is not None:
            return shown, r.matched, ""
    return shown, None, m.flush()


def test_no_stop_strings_passes_through() -> None:
    assert run([], ["a", "b"]) == ("ab", None, "")
    assert not StopMatcher(["", ""])


def test_match_inside_one_piece() -> None:
    assert run(["STOP"], ["hello STOP world"]) == ("hello ", "STOP", "")


def test_match_across_pieces_is_never_shown() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("abc</").text == "abc"  # "</" could start the stop string: held back
    assert m.feed("en").text == ""
    r = m.feed("d>tail")
    assert r.text == "" and r.matched == "</end>"
    assert m.feed("more").text == ""  # finished: nothing after the match


def test_held_text_released_when_it_cannot_match() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("x</e").text == "x"
    assert m.feed("nx").text == "</enx"


def test_flush_returns_partial_prefix_at_end() -> None:
    assert run(["Observation:"], ["The result. Obs"]) == ("The result. ", None, "Obs")


def test_first_ending_of_several_stops_wins() -> None:
    assert run(["world", "lo w"], ["hello", " world"]) == ("hel", "lo w", "")
    assert run(["bc", "abcd"], ["xab", "cd"]) == ("xa", "bc", "")  # "bc" ends before "abcd" does
    assert run(["bc", "abcd"], ["xabcd"]) == ("xa", "bc", "")  # ...however the text is cut
    assert run(["cd", "abcd"], ["xabcd"]) == ("x", "abcd", "")  # same end: the longer one


def test_multibyte_stop_strings() -> None:
    assert run(["。", "🎉"], ["你好", "世界🎉", "再见"]) == ("你好世界", "🎉", "")


def test_random_against_reference() -> None:
    """Whatever the split, the shown text ends where the first stop occurrence to end begins."""
    rng = random.Random(0)
    alphabet = "ab c"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        hits = sorted((text.find(s) + len(s), text.find(s)) for s in stops if s in text)
        shown, matched, held = run(stops, pieces)
        if hits:
            end, pos = hits[0]
            assert shown == text[:pos] and matched is not None and text[pos:end] == matched
        else:
            assert matched is None and shown + held == text
