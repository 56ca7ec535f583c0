"""Incremental detokenization with stop strings, for streamed and whole completions.

Text is released only once it is final: not while the last token may be half a UTF-8
character (the decoder shows U+FFFD), and not while the tail could still grow into a stop
string. When a stop string appears, the text before it is the whole answer.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.emitted = 0
        """Characters of the decoded text already released."""
        self.stopped = False

    def add(self, token_id: int, final: bool = False) -> str:
        """Feed one token; return the text that became final (maybe empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stop:
            at = text.find(stop)
            if at != -1:
                self.stopped = True
                return self._release(text, at)
        if final:
            return self._release(text, len(text))
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        safe -= self._held_for_stop(text[:safe])
        return self._release(text, safe)

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._release(text, len(text))

    def _release(self, text: str, upto: int) -> str:
        upto = max(upto, self.emitted)
        chunk = text[self.emitted : upto]
        self.emitted = upto
        return chunk

    def _held_for_stop(self, text: str) -> int:
        """How many trailing characters might be the start of a stop string."""
        held = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    held = max(held, n)
                    break
        return held
