"""From token ids to the text a client sees, one token at a time: the incremental detokenizer and the
stop strings.

A token is not a piece of text on its own: a byte-level tokenizer splits a character over several
tokens (the first ones decode to U+FFFD), and a SentencePiece one writes a word's leading space only
beside the word before it. So the text of a new token is what decoding a short window of ids gives
beyond what the same window without it gave, and nothing is emitted while it ends in U+FFFD
(vLLM's way). A stop string may arrive split over tokens: text that could be the start of one is
held back until it can no longer be, so no client ever sees part of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to
CONTEXT_TOKENS = 6  # prompt tokens decoded before the first new one: what its leading space depends on


class Tokenizer(Protocol):
    """What is needed of a Hugging Face ``tokenizers.Tokenizer``."""

    def encode(self, text: str, add_special_tokens: bool = True) -> Any: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer:
    """The text of each new token of one sequence (``add``), and what is left at its end (``flush``)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # the window decoded starts here
        self.read = len(self.ids)  # text of the ids before this index is emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """The text this token adds (maybe empty: an unfinished character, a special token)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """The text of tokens not yet emitted (an unfinished character at the very end), once."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    """How one token is named in logprobs: its text, or ``token_id:N`` for a version without a tokenizer
    (vLLM's spelling)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


class StopStrings:
    """Text in, text safe to show out: ``feed`` returns (text, stopped). The text stops before the first
    stop string (which is not shown, as OpenAI does); while the text's end could be the start of a stop
    string it is held back, and ``flush`` gives it at the sequence's end."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        self.pending += text
        found = [index for index in (self.pending.find(stop) for stop in self.stops) if index >= 0]
        if found:
            self.stopped = True
            shown, self.pending = self.pending[:min(found)], ""
            return shown, True
        keep = self._held(self.pending)
        shown, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return shown, False

    def _held(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def flush(self) -> str:
        shown, self.pending = ("" if self.stopped else self.pending), ""
        return shown
