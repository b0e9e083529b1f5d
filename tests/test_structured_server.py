"""response_format, tools and tool_choice on the OpenAI endpoint, driven by the official openai client,
in process (the app over a tiny random chat model of each tool-call family)."""

from __future__ import annotations

import json
import time

import pytest

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance")
from starlette.testclient import TestClient  # noqa: E402

from structured_schemas import SCHEMAS  # noqa: E402
from tiny_chat import make_chat_tiny  # noqa: E402

from hotcold.models.loader import load_model  # noqa: E402
from hotcold.server.app import create_app  # noqa: E402
from hotcold.server.engine import ServingEngine  # noqa: E402

MODEL = "tiny"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": SCHEMAS["weather_tool"]}}
ORDER = {"type": "function", "function": {"name": "place_order", "parameters": SCHEMAS["order"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Served:
    def __init__(self, path):
        self.engine = ServingEngine(lambda: load_model(path, "cpu", "float32"), max_concurrency=4, ctx=8192)
        self.engine.start()
        deadline = time.monotonic() + 60
        while not self.engine.ready:
            assert self.engine.state != "failed", self.engine.load_error
            assert time.monotonic() < deadline
            time.sleep(0.05)
        self.http = TestClient(create_app(self.engine, MODEL))
        self.client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=self.http,
                                    max_retries=0)

    def close(self):
        self.http.close()
        self.engine.close()


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("chat_tiny")


@pytest.fixture(scope="module", params=["qwen", "llama3", "mistral", "plain"])
def served(request, chat_dir):
    s = Served(make_chat_tiny(request.param, chat_dir))
    yield s
    s.close()


@pytest.fixture(scope="module")
def qwen(chat_dir):
    s = Served(make_chat_tiny("qwen", chat_dir))
    yield s
    s.close()


def _assert_400(r, param: str, words: str = "") -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert "\n" not in err["message"] and words in err["message"], err
    return err["message"]


# -- response_format --------------------------------------------------------------------------


class Line(pydantic.BaseModel):
    sku: str
    qty: int = pydantic.Field(ge=1, le=9)


class Order(pydantic.BaseModel):
    id: str = pydantic.Field(pattern="^[A-Z]{3}-[0-9]{4}$")
    lines: list[Line] = pydantic.Field(min_length=1, max_length=3)
    status: str


def test_parse_with_a_pydantic_model(qwen):
    for seed in (1, 2):
        resp = qwen.client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Order, seed=seed,
                                                  max_tokens=120)
        msg = resp.choices[0].message
        assert resp.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Order), msg.content
        jsonschema.validate(json.loads(msg.content), Order.model_json_schema())


def test_json_schema_on_chat_streamed_and_on_completions(qwen):
    schema = SCHEMAS["event"]
    fmt = {"type": "json_schema", "json_schema": {"name": "event", "schema": schema, "strict": True}}
    chunks = qwen.client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, seed=3,
                                                 max_tokens=120, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    r = qwen.http.post("/v1/completions", json={"model": MODEL, "prompt": "JSON:", "max_tokens": 120, "seed": 4,
                                                "response_format": fmt})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


def test_json_object(qwen):
    resp = qwen.client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                               seed=5, max_tokens=120)
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


BAD_FORMATS = [
    ({"type": "xml"}, "'xml' does not exist"),
    ({"type": "json_schema"}, "json_schema.schema is missing"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "([a-z"}}}}}, "at /properties/a"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nothing"}}}, "nothing"),
]


@pytest.mark.parametrize("fmt,words", BAD_FORMATS, ids=[w for _, w in BAD_FORMATS])
def test_bad_response_format_is_400(qwen, fmt, words):
    for route, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Hi"})):
        r = qwen.http.post(route, json={"model": MODEL, **body, "response_format": fmt, "max_tokens": 4})
        _assert_400(r, "response_format", words)


# -- tools --------------------------------------------------------------------------------------


def _args(call, tool) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_named_and_required_tool_calls_round_trip(served):
    client = served.client
    for choice, tool in (({"type": "function", "function": {"name": "get_weather"}}, WEATHER), ("required", None)):
        resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, ORDER], tool_choice=choice,
                                              seed=6, max_tokens=120)
        c = resp.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
        call = c.message.tool_calls[0]
        tool = tool or {"get_weather": WEATHER, "place_order": ORDER}[call.function.name]
        assert call.function.name == tool["function"]["name"] and call.type == "function" and call.id
        _args(call, tool)
        # the client runs the tool and sends its result back; the model answers in text
        messages = ASK + [c.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
        answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, ORDER],
                                                tool_choice="none", seed=7, max_tokens=8)
        assert answer.choices[0].message.tool_calls is None
        assert answer.choices[0].finish_reason in ("stop", "length")


def test_tools_are_rendered_by_the_template(served):
    tok = served.engine.lm.tokenizer
    from hotcold.server.schemas import Message
    from hotcold.server.tools import render_messages, syntax_of

    syntax = syntax_of(tok.chat_template)
    call = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [Message(**m) for m in ASK + [{"role": "assistant", "tool_calls": [call]},
                                            {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"}]]
    messages, extra = render_messages(history, syntax, [WEATHER])
    text = tok.apply_chat_template(messages, **extra)
    assert "get_weather" in text and "Weather in a city" in text and "Oslo" in text and "sunny" in text
    marker = {"hermes": "<tool_call>", "llama3": '"parameters": {"city": "Oslo"}', "mistral": "[TOOL_CALLS]",
              "generic": "<tool_call>"}[syntax]
    assert marker in text


def test_streamed_tool_calls_match_the_whole_reply(served):
    for choice in ({"type": "function", "function": {"name": "place_order"}}, "required"):
        kwargs = dict(model=MODEL, messages=ASK, tools=[ORDER], tool_choice=choice, seed=8, max_tokens=120)
        whole = served.client.chat.completions.create(**kwargs).choices[0]
        calls, finish = {}, None
        for chunk in served.client.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                entry["name"] = (tc.function.name if tc.function else None) or entry["name"]
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and len(calls) == len(whole.message.tool_calls)
        for i, call in enumerate(whole.message.tool_calls):
            assert calls[i]["name"] == call.function.name
            assert json.loads(calls[i]["arguments"]) == json.loads(call.function.arguments)
            jsonschema.validate(json.loads(calls[i]["arguments"]), SCHEMAS["order"])


def test_auto_without_a_call_answers_in_content(qwen):
    resp = qwen.client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], seed=9, max_tokens=6)
    c = resp.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")


BAD_TOOLS = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "'get_time'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools", "name is missing"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "letters, digits"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strng"}}}}}]}, "tools",
     "tools[0].function.parameters at /properties/x"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "of type 'object'"),
]


@pytest.mark.parametrize("fields,param,words", BAD_TOOLS, ids=[w for _, _, w in BAD_TOOLS])
def test_bad_tools_are_400_before_decoding(qwen, fields, param, words):
    before = qwen.engine.generator.stats
    r = qwen.http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **fields})
    _assert_400(r, param, words)
    assert qwen.engine.generator.stats is before  # nothing was generated
