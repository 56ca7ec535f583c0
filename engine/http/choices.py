"""One generation's choices as OpenAI shapes them: text, finish reason, usage, log-probabilities.

A request with `n` choices runs `n` generations; each `Choice` turns its token events into text
(through the stop-string-aware detokenizer) and keeps the log-probabilities of tokens whose
text it has not yet handed out, so a streamed chunk carries the log-probabilities of its own
tokens. `Completion` shapes whole responses and stream chunks for both endpoints.
"""

from __future__ import annotations

import time
import uuid

from engine.http.detokenize import Detokenizer
from engine.jobs import TokenEvent


class Choice:
    def __init__(self, index: int, request_id: int, tokenizer, stop: list[str]):
        self.index = index
        self.request_id = request_id
        self.detok = Detokenizer(tokenizer, stop)
        self.tokens = 0
        self.finish_reason: str | None = None
        self.logprobs: list[TokenEvent] = []
        """Events with log-probabilities whose text has not been handed out yet."""

    def feed(self, event: TokenEvent) -> str:
        """Take one token; the text that became final (maybe empty). A stop string finishes it."""
        self.tokens += 1
        if event.logprobs is not None:
            self.logprobs.append(event)
        text = self.detok.add(event.token_id, final=event.finish_reason is not None)
        if self.detok.stopped:
            self.finish_reason = "stop"
        elif event.finish_reason is not None:
            self.finish_reason = "length" if event.finish_reason == "length" else "stop"
        return text

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def take_logprobs(self) -> list[TokenEvent]:
        taken, self.logprobs = self.logprobs, []
        return taken


class Completion:
    """The response of one request: its choices, and the shapes of whole bodies and chunks."""

    def __init__(self, tokenizer, model: str, prompt_tokens: int, chat: bool, logprobs: bool):
        self.tokenizer = tokenizer
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.chat = chat
        self.want_logprobs = logprobs
        self.choices: list[Choice] = []
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    def usage(self) -> dict:
        generated = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": generated, "total_tokens": self.prompt_tokens + generated}

    def whole(self, texts: list[str]) -> dict:
        choices = []
        for choice, text in zip(self.choices, texts):
            logprobs = self._logprobs(choice.take_logprobs()) if self.want_logprobs else None
            if self.chat:
                message = {"role": "assistant", "content": text}
                choices.append({"index": choice.index, "message": message, "finish_reason": choice.finish_reason, "logprobs": logprobs})
            else:
                choices.append({"index": choice.index, "text": text, "finish_reason": choice.finish_reason, "logprobs": logprobs})
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    def chunk(self, choice: Choice, text: str | None, first: bool = False) -> dict:
        """A stream chunk of one choice: its first (chat: the role), some text, or its end (text None)."""
        finish = choice.finish_reason if text is None and not first else None
        logprobs = self._logprobs(choice.take_logprobs()) if self.want_logprobs and not first else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            body = {"index": choice.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            body = {"index": choice.index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        return self._envelope([body])

    def usage_chunk(self) -> dict:
        return {**self._envelope([]), "usage": self.usage()}

    def _envelope(self, choices: list[dict]) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, events: list[TokenEvent]) -> dict | None:
        if not events:
            return {"content": []} if self.chat else None
        if self.chat:
            return {"content": [self._chat_entry(e.token_id, e.logprobs.logprob, e.logprobs.top) for e in events], "refusal": None}
        tokens = [self._text(e.token_id) for e in events]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprobs.logprob for e in events],
            "top_logprobs": [{self._text(t): lp for t, lp in e.logprobs.top} for e in events],
            "text_offset": offsets,
        }

    def _chat_entry(self, token_id: int, logprob: float, top=None) -> dict:
        text = self._text(token_id)
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        if top is not None:
            entry["top_logprobs"] = [self._chat_entry(t, lp) for t, lp in top]
        return entry

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
