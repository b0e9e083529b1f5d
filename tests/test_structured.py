"""Structured outputs and tool calls: constrained decoding on tiny random models (only the grammar can
make their replies JSON), the OpenAI endpoint driven by the official client, tool-call syntaxes of
the Qwen, Llama 3 and Mistral families, and a few schemas on SmolLM2 and Gemma 3."""

from __future__ import annotations

import json
import random

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from structured_schemas import SCHEMAS  # noqa: E402
from tiny_chat import make_chat_tiny  # noqa: E402

from hotcold.models.generate import Generator  # noqa: E402
from hotcold.models.loader import load_model  # noqa: E402
from hotcold.models.sampling import SamplingParams  # noqa: E402
from hotcold.server.constrain import GrammarError, compile_json  # noqa: E402
from hotcold.server.tools import ToolStream, parse_calls, syntax_of  # noqa: E402

SAMPLED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
GREEDY = SamplingParams(temperature=0.0)
FORMATS = jsonschema.FormatChecker()


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("chat_tiny")


@pytest.fixture(scope="module")
def tiny(chat_dir):
    torch.manual_seed(0)
    lm = load_model(make_chat_tiny("qwen", chat_dir), "cpu", "float32")
    return lm, Generator(lm, max_context=256)


def _prompt(lm) -> list[int]:
    tok = lm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Answer in JSON."}]), add_special_tokens=False)


def _generate(lm, gen, schema, params=SAMPLED, seed=1, max_tokens=160, overlap=True):
    constraint = compile_json(lm.tokenizer, lm.config.vocab_size, schema).matcher(overlap=overlap)
    text = "".join(e.text for e in gen.generate(_prompt(lm), max_tokens, params, seed=seed, constraint=constraint))
    return text, gen.stats


def _valid(text: str, schema) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema or {"type": "object"}, format_checker=FORMATS)
    return value


# -- constrained decoding on a tiny random model ----------------------------------------------


def test_without_a_grammar_the_tiny_model_does_not_write_json(tiny):
    lm, gen = tiny
    for seed in range(3):
        text = "".join(e.text for e in gen.generate(_prompt(lm), 40, SAMPLED, seed=seed))
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue
        assert not isinstance(value, dict), text  # a lone string ('""') parses, but no schema here takes it


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_reply_follows_the_schema(tiny, name):
    lm, gen = tiny
    text, stats = _generate(lm, gen, SCHEMAS[name])
    assert stats.finish_reason == "stop", text
    _valid(text, SCHEMAS[name])


@pytest.mark.parametrize("name", ["order", "pattern", "string_enum", "any_of_objects", "defs_and_ref", "top_level_array"])
def test_greedy_reply_follows_the_schema(tiny, name):
    lm, gen = tiny
    text, stats = _generate(lm, gen, SCHEMAS[name], GREEDY)
    assert stats.finish_reason == "stop", text
    _valid(text, SCHEMAS[name])


def test_objects_get_no_keys_beyond_their_properties(tiny):
    lm, gen = tiny
    schema = SCHEMAS["nested_object"]  # says nothing of other keys: JSON Schema would allow them
    for seed in range(4):
        text, stats = _generate(lm, gen, schema, seed=seed)
        value = _valid(text, schema)
        assert set(value) <= set(schema["properties"]) and set(value["user"]) <= {"id", "profile"}, text
    value = _valid(_generate(lm, gen, SCHEMAS["map_of_numbers"], seed=1)[0], SCHEMAS["map_of_numbers"])
    assert isinstance(value, dict)  # additionalProperties given: keys of the model's choosing


def test_any_json_object(tiny):
    lm, gen = tiny
    for seed in range(3):
        text, stats = _generate(lm, gen, None, seed=seed)
        assert stats.finish_reason == "stop" and isinstance(json.loads(text), dict), text


def test_overlapped_mask_gives_the_same_tokens(tiny):
    lm, gen = tiny
    for params in (GREEDY, SAMPLED):
        _, a = _generate(lm, gen, SCHEMAS["order"], params, overlap=True)
        _, b = _generate(lm, gen, SCHEMAS["order"], params, overlap=False)
        assert a.token_ids == b.token_ids


def test_max_tokens_cuts_a_constrained_reply_with_length(tiny):
    lm, gen = tiny
    text, stats = _generate(lm, gen, SCHEMAS["order"], max_tokens=5)
    assert stats.finish_reason == "length" and stats.completion_tokens == 5


BAD_SCHEMAS = [
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "([a-z"}}}, "at /properties/a cannot be enforced: regex"),
    ({"type": "object", "properties": {"b": {"type": "array", "items": {"type": "strnig"}}}},
     "at /properties/b/items cannot be enforced: Invalid type: strnig"),
    ({"$ref": "#/$defs/missing"}, "/$defs/missing"),
    ({"type": "object", "if": {"properties": {"a": {"const": 1}}}}, '"if"'),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}, "required": ["a"]},
     "unsatisfiable"),
]


@pytest.mark.parametrize("schema,word", BAD_SCHEMAS, ids=[json.dumps(s)[:40] for s, _ in BAD_SCHEMAS])
def test_a_schema_the_engine_cannot_compile_raises_naming_it(tiny, schema, word):
    lm, _ = tiny
    with pytest.raises(GrammarError) as e:
        compile_json(lm.tokenizer, lm.config.vocab_size, schema, "response_format.json_schema.schema").matcher()
    message = str(e.value)
    assert message.startswith("response_format.json_schema.schema") and "\n" not in message
    assert word in message


# -- tool-call syntaxes ---------------------------------------------------------------------------


def test_template_families_are_recognised(chat_dir):
    from hotcold.models.tokenizer import Tokenizer

    for family, syntax in (("qwen", "hermes"), ("llama3", "llama3"), ("mistral", "mistral")):
        assert syntax_of(Tokenizer.from_hf_folder(make_chat_tiny(family, chat_dir)).chat_template) == syntax
    assert syntax_of(Tokenizer.from_hf_folder(make_chat_tiny("plain", chat_dir)).chat_template) == "generic"


PARSE_CASES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
               '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", {"x": 1}), ("b", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]',
     None, [("get_weather", {"city": "Paris"}), ("f", {})]),
]


@pytest.mark.parametrize("syntax,text,content,calls", PARSE_CASES, ids=[c[0] for c in PARSE_CASES])
def test_tool_calls_are_parsed_whole_and_streamed(syntax, text, content, calls):
    got_content, got = parse_calls(text, syntax)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got) and all(len(c.id) == 9 and c.id.isalnum() for c in got)
    rng = random.Random(0)
    for _ in range(5):  # the same text in random pieces
        stream, sent, i = ToolStream(syntax), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            sent.append(stream.feed(text[i:i + n]))
            i += n
        tail, streamed = stream.finish()
        assert ("".join(sent) + tail).strip() == (content or "")
        assert [(c.name, json.loads(c.arguments)) for c in streamed] == calls


@pytest.mark.parametrize("syntax", ["hermes", "llama3", "mistral"])
def test_text_without_a_call_is_content(syntax):
    for text in ("The weather is fine.", "Use <tool_ with care", "{not json", "[TOOL_CALLS] nothing"):
        content, calls = parse_calls(text, syntax)
        assert calls == [] and content == text
        stream = ToolStream(syntax)
        sent = "".join(stream.feed(ch) for ch in text)
        tail, calls = stream.finish()
        assert calls == [] and sent + tail == text


# -- real models ----------------------------------------------------------------------------------

REAL_SCHEMAS = ["event", "one_of_tagged", "pattern", "integer_range", "defs_and_ref", "weather_tool"]
# sampled as clients do, with llama.cpp's usual repeat penalty: greedy, these small models can repeat a
# character inside a string or a number until max_tokens (valid so far, but never finished)
REAL_SAMPLING = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_real_models_follow_schemas(model, smollm2_path, gemma3_path):
    lm = load_model(smollm2_path if model == "smollm2" else gemma3_path, "cpu")
    gen = Generator(lm, max_context=1024)
    tok = lm.tokenizer
    for name in REAL_SCHEMAS:
        schema = SCHEMAS[name]
        messages = [{"role": "user", "content": f"Write one example as JSON following this schema: {json.dumps(schema)}"}]
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        constraint = compile_json(tok, lm.config.vocab_size, schema).matcher()
        text = "".join(e.text for e in gen.generate(ids, 200, REAL_SAMPLING, seed=0, constraint=constraint))
        assert gen.stats.finish_reason == "stop", (name, text)
        _valid(text, schema)


# -- the CLI ----------------------------------------------------------------------------------------


def test_cli_json_schema_prints_json_that_validates(chat_dir, tmp_path):
    from conftest import run_cli

    schema = SCHEMAS["order"]
    path = tmp_path / "order.json"
    path.write_text(json.dumps(schema))
    r = run_cli("run", make_chat_tiny("qwen", chat_dir), "-p", "An order:", "--json-schema", path, "--json",
                "-t", "1", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--seed", "1", "-n", "160",
                "--device", "cpu", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "stop"
    _valid(out["text"], schema)


def test_cli_bad_schema_file_is_one_line_before_the_model_loads(tmp_path):
    from conftest import run_cli

    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "properties": {"a": {"type": "string", "pattern": "([a"}}}')
    broken = tmp_path / "broken.json"
    broken.write_text("{oops")
    for path, words in ((bad, "at /properties/a"), (broken, "not JSON"), (tmp_path / "none.json", "no such file")):
        r = run_cli("run", "/no/such/model", "-p", "hi", "--json-schema", path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"error: {path}") and words in r.stderr  # the schema, not the missing model
