"""Tool calls: the request's tools checked, rendered through the model's chat template, and the
model's tool-call syntax parsed back into OpenAI `tool_calls`, whole or while streaming.

Three families of syntax are read, chosen from the chat template's text:

* "hermes" (Qwen 2.5/3 and templates that write `<tool_call>`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call;
* "llama3" (Llama 3.x): the whole reply is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;`;
* "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

A template that never mentions tools gets them in a system message, in the hermes syntax, and the
conversation's tool calls and results as text. With `tool_choice` "required" or a named function the
reply is constrained by a grammar to the calls' JSON (`call_schema`), whatever the family.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, Optional

from hotcold.server.schemas import BadRequest, Message, NamedToolChoice, Tool

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """9 letters and digits: what Mistral's templates require, and opaque to OpenAI clients."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or new_call_id()

    def openai(self, index: Optional[int] = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


# -- the request ------------------------------------------------------------------------


def check_tools(tools: Optional[list[Tool]], choice) -> tuple[list[dict], Any]:
    """The tools as plain dicts ({"type": "function", "function": {...}}) and the effective choice
    ("none", "auto", "required" or a function name); raises BadRequest."""
    if not tools:
        if isinstance(choice, NamedToolChoice) or choice == "required":
            raise BadRequest("tool_choice needs tools; send the functions the model may call in 'tools'",
                             "tool_choice")
        return [], "none"
    out, names = [], set()
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise BadRequest(f"tools[{i}].type '{tool.type}' is not supported; only 'function' is", "tools")
        f = tool.function
        if not f.name:
            raise BadRequest(f"tools[{i}].function.name is missing; every tool needs a name", "tools")
        if not NAME_RE.match(f.name):
            raise BadRequest(f"tools[{i}].function.name '{f.name}' must be 1-64 letters, digits, '_' or '-'", "tools")
        if f.name in names:
            raise BadRequest(f"tools[{i}].function.name '{f.name}' is given twice; names must be unique", "tools")
        names.add(f.name)
        params = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        if params.get("type", "object") != "object":
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema of type 'object'", "tools")
        fn = {"name": f.name, **({"description": f.description} if f.description else {}), "parameters": params}
        out.append({"type": "function", "function": fn})
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise BadRequest(f"tool_choice names the function '{choice.function.name}', which is not among the "
                             f"tools ({', '.join(sorted(names))})", "tool_choice")
        return out, choice.function.name
    return out, choice or "auto"


def parameters_of(tools: list[dict], name: str) -> dict:
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


def call_schema(tools: list[dict], choice: str, parallel: bool = True) -> dict:
    """The JSON the reply is constrained to for tool_choice "required" (an array of calls) or a
    named function (that function's arguments)."""
    if choice != "required":
        return parameters_of(tools, choice)
    one = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                             "arguments": t["function"]["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {"type": "array", "items": one[0] if len(one) == 1 else {"anyOf": one}, "minItems": 1,
            **({} if parallel else {"maxItems": 1})}


def constrained_calls(text: str, choice: str) -> list[Call]:
    """The calls in a reply constrained by call_schema (raises ValueError if it is incomplete)."""
    value = json.loads(text)
    if choice != "required":
        return [Call(choice, json.dumps(value, ensure_ascii=False))]
    return [Call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]


# -- rendering --------------------------------------------------------------------------


def syntax_of(template: str) -> str:
    """Which tool-call syntax a chat template teaches ("generic": it does not render tools)."""
    if MISTRAL_MARK in template:
        return "mistral"
    if HERMES_OPEN in template:
        return "hermes"
    if "tools" in template and ("<|eot_id|>" in template or PYTHON_TAG in template):
        return "llama3"
    return "hermes" if re.search(r"\btools\b", template) else "generic"


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def render_messages(messages: list[Message], syntax: str, tools: list[dict]) -> tuple[list[dict], dict]:
    """(messages as the chat template takes them, extra template variables)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    if syntax != "generic":
        return out, ({"tools": tools} if tools else {})
    return _as_text(out, tools), {}


def _as_text(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For a template without tools: the tools in a system message, calls and results as plain turns."""
    if not tools and not any(d.get("tool_calls") or d["role"] == "tool" for d in messages):
        return messages
    out = []
    for d in messages:
        result = d["role"] == "tool"
        if d.get("tool_calls"):
            calls = "\n".join(f"{HERMES_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                              "arguments": c["function"]["arguments"]},
                                                             ensure_ascii=False) + f"\n{HERMES_CLOSE}"
                              for c in d["tool_calls"])
            d = {"role": "assistant", "content": (d["content"] + "\n" if d["content"] else "") + calls}
        elif d["role"] == "tool":
            d = {"role": "user", "content": f"<tool_response>\n{d['content']}\n</tool_response>"}
        if result and out and out[-1]["role"] == "user":  # results join one turn: templates may need alternation
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + d["content"]}
            continue
        out.append(d)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        preamble = ("You may call functions to answer. They are listed in <tools></tools>:\n<tools>\n" + listing +
                    "\n</tools>\nTo call one, answer with <tool_call>\n{\"name\": <function name>, \"arguments\": "
                    "<arguments as a JSON object>}\n</tool_call>")
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


# -- parsing ----------------------------------------------------------------------------


def _call(obj: Any) -> Optional[Call]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _arguments(args)
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any]:
    """The JSON values written one after another in text (separated by whitespace, ',' or ';')."""
    dec, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i >= len(text):
            return values
        value, i = dec.raw_decode(text, i)
        values.append(value)


def parse_calls(text: str, syntax: str) -> tuple[Optional[str], list[Call]]:
    """(the reply's content, its tool calls); a reply without a well-formed call is all content."""
    try:
        if syntax == "mistral" and MISTRAL_MARK in text:
            head, _, rest = text.partition(MISTRAL_MARK)
            values = _json_values(rest)
            items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
            calls = [_call(v) for v in items]
            if calls and all(calls):
                return head.strip() or None, calls
        elif syntax == "llama3":
            body = text.strip()
            if body.startswith(PYTHON_TAG):
                body = body[len(PYTHON_TAG):]
            if body.lstrip().startswith("{"):
                calls = [_call(v) for v in _json_values(body)]
                if calls and all(calls):
                    return None, calls
        elif HERMES_OPEN in text:
            head = text.split(HERMES_OPEN, 1)[0]
            blocks = re.findall(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", text, re.S)
            calls = [_call(v) for b in blocks for v in _json_values(b.strip())]
            if calls and all(calls):
                return head.strip() or None, calls
    except (json.JSONDecodeError, ValueError):
        pass
    return text, []


class ToolStream:
    """Splits a streamed reply into content to send now and a tool-call part held back to the end.

    feed(text) returns the content that can no longer be the start of a call; finish() returns the
    rest of the content and the calls."""

    def __init__(self, syntax: str):
        self.syntax = syntax
        self.mark = MISTRAL_MARK if syntax == "mistral" else HERMES_OPEN
        self._held = ""  # text not yet sent
        self._sent = ""
        self._in_call = False

    def feed(self, text: str) -> str:
        self._held += text
        if self._in_call:
            return ""
        if self.syntax == "llama3":
            if not self._sent:  # a call is the whole reply: decide on its first characters
                stripped = self._held.lstrip()
                if not stripped or PYTHON_TAG.startswith(stripped):
                    return ""
                if stripped.startswith("{") or stripped.startswith(PYTHON_TAG):
                    self._in_call = True
                    return ""
            return self._send(len(self._held))
        at = self._held.find(self.mark)
        if at >= 0:
            self._in_call = True
            return self._send(at)
        keep = 0
        for n in range(min(len(self.mark) - 1, len(self._held)), 0, -1):
            if self._held.endswith(self.mark[:n]):
                keep = n
                break
        return self._send(len(self._held) - keep)

    def _send(self, n: int) -> str:
        out, self._held = self._held[:n], self._held[n:]
        self._sent += out
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """(content still to send, the calls)."""
        content, calls = parse_calls(self._held, self.syntax)
        if not calls:
            return self._send(len(self._held)), []
        return (content or "") if self.syntax != "llama3" else "", calls
