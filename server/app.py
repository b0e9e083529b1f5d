"""The FastAPI app: OpenAI-compatible routes over an ServingEngine, with OpenAI-shaped errors, health and metrics."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from hotcold.errors import ContextLengthError, HotcoldError
from hotcold.server.engine import Busy, ServingEngine, Job, NotReady
from hotcold.server.metrics import Metrics, RequestCounter
from hotcold.server.openai_format import SSE_DONE, APIError, Reply, error_body, sse
from hotcold.server.schemas import BadRequest, ChatCompletionRequest, CompletionRequest
from hotcold.server.tools import (Call, ToolStream, call_schema, check_tools, constrained_calls, parse_calls,
                                  render_messages, syntax_of)

_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _error(status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
           code: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Pydantic's first complaint as a 400 naming the field (FastAPI would answer 422)."""
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        reason = err.get("ctx", {}).get("error", "")
        return _error(400, f"could not parse the request body as JSON ({reason})".replace(" ()", ""))
    path = []
    for part in err["loc"][1:] if err["loc"][:1] == ("body",) else err["loc"]:
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part[:1].isupper()):
            break  # pydantic's union-branch tags, not field names
        path.append(str(part))
    if not path:
        if "json" not in request.headers.get("content-type", "json"):
            return _error(400, "send the request body as JSON, with the header 'Content-Type: application/json'")
        return _error(400, "the request body must be a JSON object")
    return _error(400, f"{'.'.join(path)}: {err['msg']}", param=path[0])


def create_app(engine: ServingEngine, model_name: str, api_key: Optional[str] = None,
               metrics: Optional[Metrics] = None) -> FastAPI:
    """The app serving `engine` under the id `model_name`; `api_key` guards /v1 when set."""
    metrics = metrics or Metrics()
    metrics.bind(engine)
    engine.on_finished = metrics.observe
    started = int(time.time())
    app = FastAPI(title="hotcold", description="OpenAI-compatible API of a hotcold model")
    app.add_middleware(RequestCounter, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest):
        return _error(400, str(exc), param=exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _validation_error(request, exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return _error(exc.status_code, message, code="not_found" if exc.status_code == 404 else None,
                      headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key; send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def not_ready() -> APIError:
        if engine.load_error:
            return APIError(503, f"the model failed to load: {engine.load_error}", "service_unavailable",
                            code="model_load_failed")
        return APIError(503, "the model is still loading; retry when /health answers 200", "service_unavailable",
                        code="model_loading")

    def require_ready() -> None:
        if not engine.ready:
            raise not_ready()

    def check_model(name: Optional[str]) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model '{name}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")

    def model_card() -> dict:
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "hotcold"}
        if engine.ready:
            card["max_model_len"] = engine.max_context
        return card

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.get("/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def get_model(name: str):
        check_model(name)
        return model_card()

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check()
        check_model(body.model)
        require_ready()
        tok = engine.lm.tokenizer
        tools, choice = check_tools(body.tools, body.tool_choice)
        syntax = syntax_of(tok.chat_template)
        offered = tools if choice != "none" else []
        messages, extra = render_messages(body.messages, syntax, offered)
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, **extra)
        except Exception as e:  # a template's raise_exception(...) or a malformed conversation
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        ids = tok.encode(text, add_special_tokens=False)
        for i, t in enumerate(tools):  # each tool's parameters must compile, whether or not it is forced
            await _grammar(t["function"]["parameters"], f"tools[{i}].function.parameters", "tools")
        if choice in ("none", "auto"):
            grammar = await _response_grammar(body)
            mode = ToolMode("auto", syntax=syntax) if offered else None
        else:
            schema = call_schema(tools, choice, body.parallel_tool_calls is not False)
            grammar = await _grammar(schema, "the tool call's arguments", "tools")
            mode = ToolMode(choice)
        return await _serve(request, body, ids, "messages", body.limit(), body.n_logprobs(), chat=True,
                            grammar=grammar, tools=mode)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check()
        check_model(body.model)
        require_ready()
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
        if isinstance(prompt, str):
            ids = engine.lm.tokenizer.encode(prompt)
        else:
            vocab = engine.lm.config.vocab_size
            if any(not 0 <= i < vocab for i in prompt):
                raise BadRequest(f"token ids must be in [0, {vocab})", "prompt")
            ids = list(prompt)
        grammar = await _response_grammar(body)
        return await _serve(request, body, ids, "prompt", body.limit(), body.logprobs, chat=False, grammar=grammar)

    async def _grammar(schema: Optional[dict], where: str, param: str):
        """The compiled grammar of JSON following schema (None: any object); a 400 naming what fails."""
        from hotcold.server.constrain import GrammarError, compile_json

        try:
            return await asyncio.to_thread(compile_json, engine.lm.tokenizer, engine.lm.config.vocab_size, schema,
                                           where)
        except GrammarError as e:
            raise APIError(400, str(e), param=param, code="invalid_schema") from None

    async def _response_grammar(body):
        wants_json, schema = body.json_schema()
        if not wants_json:
            return None
        where = "response_format.json_schema.schema" if schema is not None else "response_format"
        return await _grammar(schema, where, "response_format")

    async def _serve(request: Request, body, ids: list[int], param: str, limit: Optional[int],
                     n_logprobs: Optional[int], chat: bool, grammar=None, tools: Optional["ToolMode"] = None):
        if not ids:
            raise BadRequest("the prompt is empty", param)
        try:
            engine.check_fits(len(ids))
        except ContextLengthError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        try:
            job = engine.submit(ids, limit or engine.max_context, body.sampling(), body.stops(), body.seed,
                                n_logprobs, bool(body.ignore_eos), grammar.matcher() if grammar else None)
        except Busy:
            raise APIError(429, f"the server is busy ({engine.max_concurrency} requests running or waiting, "
                                "its --max-concurrency); retry later", "rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except NotReady:
            raise not_ready() from None
        reply = Reply(chat, model_name, "fp_" + engine.lm.fingerprint, lambda i: engine.lm.tokenizer.decode([i]),
                      include_usage=body.include_usage)
        if body.stream:
            return StreamingResponse(_stream(job, reply, tools), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(request, job, reply, tools)

    async def _collect(request: Request, job: Job, reply: Reply, tools: Optional["ToolMode"] = None) -> JSONResponse:
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        events = []
        try:
            async for event in engine.stream(job):
                events.append(event)
        except HotcoldError as e:
            raise APIError(400, str(e)) from None
        except Exception as e:
            raise APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error") from None
        finally:
            watcher.cancel()
            job.cancel()
        text = "".join(e.text for e in events)
        if tools is None:
            return JSONResponse(reply.response(text, events, job.stats))
        content, calls = tools.split(text, job.stats.finish_reason)
        return JSONResponse(reply.response(content, events, job.stats, [c.openai() for c in calls] or None))

    async def _stream(job: Job, reply: Reply, tools: Optional["ToolMode"] = None):
        """SSE chunks; if the client goes away, Starlette cancels this and `finally` frees the slot."""
        try:
            if reply.chat:
                yield reply.chunk(text="", role=True)
            async for event in engine.stream(job):
                if tools is not None:
                    for chunk in tools.stream(reply, event):
                        yield chunk
                    continue
                if event.text or event.logprob is not None:
                    yield reply.chunk(text=event.text, events=[event])
                if event.finish_reason:
                    yield reply.chunk(finish_reason=event.finish_reason)
            if reply.include_usage:
                yield reply.usage_chunk(job.stats)
        except Exception as e:  # headers are sent: report the failure in the stream
            if isinstance(e, HotcoldError):
                yield sse(error_body(str(e)))
            else:
                yield sse(error_body(f"generation failed: {type(e).__name__}: {e}", "server_error"))
        finally:
            job.cancel()
        yield SSE_DONE

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if not engine.ready:
            exc = not_ready()
            return _error(exc.status, exc.message, exc.type, code=exc.code)
        return {"status": "ok", "model": model_name, "running": engine.running, "waiting": engine.waiting,
                "max_concurrency": engine.max_concurrency, "parallel": engine.parallel, "context_length": engine.max_context}

    @app.get("/metrics")
    async def prometheus_metrics():
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    return app


async def _cancel_on_disconnect(request: Request, job: Job, every_s: float = 0.25) -> None:
    """For non-streamed requests: cancel the job when the client hangs up."""
    while not await request.is_disconnected():
        await asyncio.sleep(every_s)
    job.cancel()


class ToolMode:
    """How a chat reply with tools becomes content and tool_calls: "auto" parses the model's own
    syntax; "required" or a function name reads the JSON the grammar constrained the reply to."""

    def __init__(self, choice: str, syntax: str = "hermes"):
        self.choice, self.syntax = choice, syntax
        self._splitter = ToolStream(syntax) if choice == "auto" else None
        self._text = ""
        self._call: Optional[Call] = None  # a named function's call, its arguments streamed as they come

    def split(self, text: str, finish_reason: Optional[str]) -> tuple[Optional[str], list[Call]]:
        """(content, calls) of a whole reply; an unfinished constrained call stays content."""
        if self.choice == "auto":
            return parse_calls(text, self.syntax)
        if finish_reason != "stop":
            return text, []
        try:
            return None, constrained_calls(text, self.choice)
        except (ValueError, KeyError, TypeError):
            return text, []

    def stream(self, reply: Reply, event):
        """The SSE chunks for one event of a streamed reply."""
        self._text += event.text
        if self.choice == "auto":
            out = self._splitter.feed(event.text)
            if out:
                yield reply.chunk(text=out)
            if event.finish_reason:
                tail, calls = self._splitter.finish()
                if tail:
                    yield reply.chunk(text=tail)
                yield from self._finish(reply, calls, event.finish_reason)
        elif self.choice != "required":  # a named function: its arguments stream as they are generated
            if self._call is None:
                self._call = Call(self.choice, "")
                yield reply.chunk(tool_calls=[{**self._call.openai(0), "function": {"name": self.choice,
                                                                                    "arguments": ""}}])
            if event.text:
                yield reply.chunk(tool_calls=[{"index": 0, "function": {"arguments": event.text}}])
            if event.finish_reason:
                yield reply.chunk(finish_reason="tool_calls" if event.finish_reason == "stop" else "length")
        elif event.finish_reason:
            content, calls = self.split(self._text, event.finish_reason)
            if content:
                yield reply.chunk(text=content)
            yield from self._finish(reply, calls, event.finish_reason)

    @staticmethod
    def _finish(reply: Reply, calls: list[Call], finish_reason: str):
        if calls:
            yield reply.chunk(tool_calls=[c.openai(i) for i, c in enumerate(calls)])
        yield reply.chunk(finish_reason="tool_calls" if calls else finish_reason)
