"""Token ids to text, one row at a time: `IncrementalDetokenizer`, and the stop-string rules.

One completion's text is decoded here and nowhere else: the torch engine's rows use it to end on a
stop string and to give `Completion.text`, and the server's stream uses it for the content it may
send. So streamed text is the plain text by construction. Fed token ids, it decodes only the
newest ones (with the previous piece as context, as vLLM's detokenizer does, so a tokenizer that
treats a leading piece specially agrees with itself), and its text grows only when it does not end
in a half UTF-8 character. It cuts the text at the first stop string and, until the row ends,
holds back a tail that may still become one. Left out: special-token skipping (the text keeps
them, as `skip_special_tokens=False`), tool-call parsing (the server's). Torch-free; see
docs/architecture.md ("The torch engine").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
"""What a tokenizer decodes an incomplete UTF-8 character to, until its last byte arrives."""


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """`ids` as text, special tokens and spacing kept exactly as sampled."""
    if not ids:
        return ""
    return str(tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))


def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index in `text` where the earliest stop string starts, or None if none occurs."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_prefix(text: str, pattern: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `pattern`."""
    for k in range(min(len(pattern) - 1, len(text)), 0, -1):
        if text.endswith(pattern[:k]):
            return k
    return 0


def settled_text(text: str, stops: Sequence[str]) -> str:
    """The part of a partial completion's text that no later token can change; pure.

    Without a trailing half character, cut at the first stop string, and without a tail that may
    still grow into one.
    """
    stops = tuple(stops)
    text = text.rstrip(REPLACEMENT)
    cut = find_stop(text, stops)
    if cut is not None:
        return text[:cut]
    held = max((held_prefix(text, s) for s in stops), default=0)
    return text[: len(text) - held]


class IncrementalDetokenizer:
    """The text of one row as its tokens arrive (see the module docstring).

    `feed` takes the new ids and returns the new settled text; `finish` ends the row and returns the
    rest. `text` is everything decoded so far, cut at a stop string once one was seen (`stopped`);
    after `finish` it is the completion's final text.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        """The ids fed so far."""
        self.text = ""
        """The decoded text of `ids[:read]` (cut at the first stop string once one occurs)."""
        self.stopped = False
        """A stop string occurred: `text` ends where it starts, and later ids are ignored."""
        self.finished = False
        self._longest = max((len(s) for s in self.stop), default=0)
        self._prefix = self._read = 0  # ids[prefix:read] decode to the latest piece of `text`
        self._given = 0  # characters of `settled()` already returned by feed / finish

    def feed(self, token_ids: Sequence[int]) -> str:
        """Add the row's new ids; the text that became settled ("" if none)."""
        if self.finished:
            raise RuntimeError("this row's detokenizer was finished; start a new one")
        if not self.stopped:
            self.ids.extend(token_ids)
            self._advance(final=False)
        return self._take()

    def finish(self) -> str:
        """The row ended: decode what is left (a trailing half character too, as U+FFFD, as a
        whole decode would) and give up the held-back tail; the rest of the text. Idempotent."""
        if not self.finished and not self.stopped:
            self._advance(final=True)
        self.finished = True
        return self._take()

    def settled(self) -> str:
        """The text no later id can change: all of it once stopped or finished."""
        if self.stopped or self.finished:
            return self.text
        return settled_text(self.text, self.stop)

    def _advance(self, final: bool) -> None:
        if self._read == len(self.ids):
            return
        context = decode(self.tokenizer, self.ids[self._prefix : self._read])
        grown = decode(self.tokenizer, self.ids[self._prefix :])
        new = grown[len(context) :] if len(grown) > len(context) else ""
        if not final and (not new or new.endswith(REPLACEMENT)):
            # Not settled yet; but a stop string completed before the half character ends the row now.
            whole = new.rstrip(REPLACEMENT)
            if whole and self._stop_in(self.text + whole, len(self.text)):
                self.text += whole
                self._cut()
            return
        start = len(self.text)
        self.text += new
        self._prefix, self._read = self._read, len(self.ids)
        if self._stop_in(self.text, start):
            self._cut()

    def _stop_in(self, text: str, start: int) -> bool:
        """Whether a stop string ends in `text[start:]` (none lies wholly before `start`)."""
        if not self.stop:
            return False
        return find_stop(text[max(0, start - self._longest + 1) :], self.stop) is not None

    def _cut(self) -> None:
        cut = find_stop(self.text, self.stop)
        assert cut is not None
        self.text, self.stopped = self.text[:cut], True

    def _take(self) -> str:
        settled = self.settled()
        new, self._given = settled[self._given :], max(self._given, len(settled))
        return new


__all__ = [
    "IncrementalDetokenizer",
    "decode",
    "find_stop",
    "held_prefix",
    "settled_text",
]
