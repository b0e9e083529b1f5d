"""Pydantic models of the OpenAI request bodies the server accepts.

Strict types (a string where a number belongs is a 400, not a coercion); unknown extra
fields are ignored, as vLLM does. Ranges follow OpenAI's documented limits.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from hotcold.models.sampling import SamplingParams


class BadRequest(Exception):
    """A well-typed request the server cannot serve; becomes a 400 naming `param`."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: Optional[str] = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers

    def text(self) -> str:
        """The content as one string; only text parts are supported."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise BadRequest(f"content part of type '{part.type}' is not supported; only text parts are",
                                 "messages")
        return "".join(p.text for p in self.content)


class _Sampling(_Body):
    """Fields shared by chat and text completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)  # 0 or -1: off (vLLM's convention)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator takes
    stop: Union[str, list[str], None] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(None, ge=1)
    ignore_eos: Optional[bool] = False  # vLLM's extension: generate max_tokens even past EOS (benchmarks)

    def check(self) -> None:
        """Checks beyond types and ranges; raises BadRequest."""
        if self.n not in (None, 1):
            raise BadRequest("only n=1 is supported", "n")

    def sampling(self) -> SamplingParams:
        """OpenAI's defaults where the request leaves a field out: temperature 1, top_p 1, no top_k/min_p."""
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(
            temperature=temperature if temperature >= 1e-5 else 0.0,  # tinier ones overflow: greedy
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
        )

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class JSONSchemaFormat(_Body):
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Body):
    type: str
    json_schema: Optional[JSONSchemaFormat] = None

    def schema_or_none(self) -> tuple[bool, Optional[dict]]:
        """(whether the reply must be JSON, the schema it must follow or None for any JSON object)."""
        if self.type not in RESPONSE_FORMATS:
            raise BadRequest(f"response_format.type '{self.type}' does not exist; use one of "
                             f"{', '.join(RESPONSE_FORMATS)}", "response_format")
        if self.type == "text":
            return False, None
        if self.type == "json_object":
            return True, None
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise BadRequest("response_format.json_schema.schema is missing; send "
                             '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}', "response_format")
        return True, self.json_schema.json_schema


class _Structured(_Sampling):
    """response_format, shared by chat and text completions."""

    response_format: Optional[ResponseFormat] = None

    def json_schema(self) -> tuple[bool, Optional[dict]]:
        return self.response_format.schema_or_none() if self.response_format else (False, None)


class FunctionDef(_Body):
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Body):
    type: str = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Structured):
    messages: list[Message] = Field(min_length=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def n_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Structured):
    prompt: Union[str, list[str], list[int]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)

    def check(self) -> None:
        super().check()
        if isinstance(self.prompt, list) and len(self.prompt) != 1 and self.prompt and isinstance(self.prompt[0], str):
            raise BadRequest("only one prompt per request is supported", "prompt")

    def limit(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions
