"""From token ids to text: the incremental detokenizer gives, token by token, exactly the text of the
whole sequence (characters split over byte-level tokens included), and stop strings split over tokens
are found and never shown."""

from __future__ import annotations

import pytest

from mlscale.data.text import train_tokenizer
from mlscale.serve.generation.text import Detokenizer, StopStrings

TEXTS = ["the quick brown fox jumps over the lazy dog", "héllo wörld, ça va? 日本語のテキスト 🙂🙂",
         "naïve café déjà vu — «quotes» and emoji 🚀 rockets"] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer

    path = train_tokenizer(TEXTS, tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=300)
    return Tokenizer.from_file(str(path))


@pytest.mark.parametrize("text", ["日本語のテキスト 🙂🙂 and more", " ça va? naïve 🚀", "plain words only"])
def test_token_by_token_text_is_the_whole_text(tokenizer, text):
    prompt = tokenizer.encode("héllo ").ids
    ids = tokenizer.encode(text).ids
    detokenizer = Detokenizer(tokenizer, prompt)
    pieces = [detokenizer.add(token) for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)  # a split character is held until it is whole
    assert "".join(pieces) + detokenizer.flush() == tokenizer.decode(ids)


def test_an_unfinished_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode("🙂").ids
    assert len(ids) > 1  # byte-level: one emoji, several tokens
    detokenizer = Detokenizer(tokenizer, [])
    assert [detokenizer.add(token) for token in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.flush() == tokenizer.decode(ids[:-1])


def _feed(stops, pieces):
    matcher = StopStrings(stops)
    shown, stopped = "", False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        shown += text
        if stopped:
            break
    return shown + ("" if stopped else matcher.flush()), stopped


@pytest.mark.parametrize(("stops", "pieces", "expected"), [
    (["STOP"], ["hello S", "T", "OP world"], ("hello ", True)),  # across three pieces
    (["\n\n"], ["a\n", "\nb"], ("a", True)),
    (["abc", "bd"], ["xab", "d"], ("xa", True)),  # the earliest stop string wins
    (["STOP"], ["ST", "ART"], ("START", False)),  # held back, then shown when it cannot be a stop
    (["STOP"], ["text ST"], ("text ST", False)),  # held to the end, then flushed
    ([], ["no", " stops"], ("no stops", False)),
])
def test_stop_strings_split_over_pieces_are_found_and_never_shown(stops, pieces, expected):
    assert _feed(stops, pieces) == expected


def test_text_that_may_start_a_stop_string_is_held_back():
    matcher = StopStrings(["</end>"])
    assert matcher.feed("answer </e") == ("answer ", False)
    assert matcher.feed("nd>") == ("", True)
