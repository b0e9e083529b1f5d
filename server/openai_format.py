"""OpenAI response bodies: errors, chat and text completions, their stream chunks, usage and logprobs."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from hotcold.models.generate import GenerationStats, TokenEvent


class APIError(Exception):
    """An error answered as `{"error": {message, type, param, code}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def sse(obj) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
    }


@dataclass
class Reply:
    """Builds the bodies of one chat (`chat=True`) or text completion."""

    chat: bool
    model: str
    fingerprint: str
    decode: Callable[[int], str]  # token id -> its text, for logprobs
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + self.id
        self._offset = 0  # text_offset of the next token, for text-completion logprobs

    def _head(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def logprobs(self, events: list[TokenEvent]) -> Optional[dict]:
        """Logprobs for `events` in the chat (`content` list) or legacy completions layout."""
        if not events or events[0].logprob is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(e.token_id, e.logprob, e.top_logprobs or []) for e in events]}
        tokens = [self.decode(e.token_id) for e in events]
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        top = [{self.decode(i): lp for i, lp in e.top_logprobs} if e.top_logprobs else None for e in events]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in events],
                "top_logprobs": top if any(t is not None for t in top) else None, "text_offset": offsets}

    def _chat_entry(self, token_id: int, logprob: float, top: list) -> dict:
        return {**self._token(token_id, logprob), "top_logprobs": [self._token(i, lp) for i, lp in top]}

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def response(self, text: Optional[str], events: list[TokenEvent], stats: GenerationStats,
                 tool_calls: Optional[list[dict]] = None) -> dict:
        """The whole (non-streamed) response; with tool_calls, finish_reason is "tool_calls"."""
        finish = "tool_calls" if tool_calls else stats.finish_reason
        choice = {"index": 0, "logprobs": self.logprobs(events), "finish_reason": finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                choice["message"]["tool_calls"] = tool_calls
        else:
            choice["text"] = text
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(stats)}

    def chunk(self, text: Optional[str] = None, events: Optional[list[TokenEvent]] = None,
              finish_reason: Optional[str] = None, role: bool = False,
              tool_calls: Optional[list[dict]] = None) -> str:
        """One SSE chunk of a streamed response (tool_calls: deltas, each with its "index")."""
        choice = {"index": 0, "logprobs": self.logprobs(events or []), "finish_reason": finish_reason}
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, stats: GenerationStats) -> str:
        """The last chunk when stream_options.include_usage is set: no choices, the usage."""
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return sse({**head, "choices": [], "usage": usage(stats)})
