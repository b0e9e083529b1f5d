"""The server engine's continuous batching and prefix cache (server/batching.py, server/engine.py).

Every request's events must equal what `Generator.generate` gives it alone, on a fresh KV cache:
token for token, text for text, with its own sampling, penalties, stop strings, logprobs and
grammar, whichever requests shared its decode steps, joined or left between them, or lent it a
cached prefix."""

from __future__ import annotations

import asyncio
import time

import pytest

from hotcold.models.generate import Generator
from hotcold.models.loader import load_model
from hotcold.models.sampling import SamplingParams
from hotcold.server.engine import ServingEngine
from tiny_chat import make_chat_tiny

CTX = 128
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A tiny qwen2 chat model with its tokenizer, quantised: its blocks take the fused batched step."""
    return load_model(make_chat_tiny("qwen", tmp_path_factory.mktemp("chat")), "cpu", "float32", quantize="q4_0")


def _engine(lm, parallel: int, cache_slots: int | None = None) -> ServingEngine:
    engine = ServingEngine(lambda: lm, max_concurrency=16, ctx=CTX, parallel=parallel, cache_slots=cache_slots)
    engine.sizes = []
    engine.start()
    deadline = time.monotonic() + 60
    while not engine.ready:
        assert engine.state != "failed", engine.load_error
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.on_step = engine.sizes.append
    return engine


def _spec(prompt, max_tokens=12, sampling=GREEDY, stop=(), seed=None, logprobs=None, ignore_eos=True,
          constraint=None) -> dict:
    return dict(prompt_ids=list(prompt), max_tokens=max_tokens, sampling=sampling, stop=list(stop), seed=seed,
                logprobs=logprobs, ignore_eos=ignore_eos, constraint=constraint)


def _alone(lm, spec: dict) -> list[tuple]:
    gen = Generator(lm, max_context=CTX)
    return [_key(e) for e in gen.generate(**spec)]


def _key(e) -> tuple:
    return e.token_id, e.text, e.finish_reason, e.logprob, e.top_logprobs


async def _collect(engine, job) -> list[tuple]:
    return [_key(e) async for e in engine.stream(job)]


def _run(engine, specs: list[dict]) -> tuple[list, list]:
    """Submit all at once; (each job's events, each job's stats)."""
    async def go():
        jobs = [engine.submit(**s) for s in specs]
        return await asyncio.gather(*(_collect(engine, j) for j in jobs)), [j for j in jobs]
    events, jobs = asyncio.run(go())
    return events, [j.stats for j in jobs]


def test_requests_in_a_batch_equal_each_alone(lm):
    tok = lm.tokenizer
    prompts = [tok.encode(t) for t in ("hello there", "a b c d e f g h", "x", "the cat sat on the mat", "12 34")]
    specs = [_spec(prompts[0], 14), _spec(prompts[1], 5),
             _spec(prompts[2], 20, SamplingParams(temperature=0.9, top_k=20), seed=7),
             _spec(prompts[3], 16, SamplingParams(temperature=0, repetition_penalty=1.3), logprobs=2),
             _spec(prompts[4], 9, ignore_eos=False)]
    refs = [_alone(lm, s) for s in specs]
    text = "".join(r[1] for r in refs[0])
    specs[0]["stop"] = [text[len(text) // 2:len(text) // 2 + 2]]  # a stop string met mid-reply
    refs[0] = _alone(lm, specs[0])
    assert refs[0][-1][2] == "stop" and len(refs[0]) < 14
    engine = _engine(lm, parallel=3)  # five requests: two wait, then join the running batch
    try:
        events, stats = _run(engine, specs)
    finally:
        engine.close()
    assert events == refs
    assert max(engine.sizes) == 3 and min(engine.sizes) < 3  # batched, and requests left and joined
    assert [s.completion_tokens for s in stats] == [len(r) for r in refs]


def test_prefix_cache_hit_copy_eviction_and_exact_repeat(lm):
    tok = lm.tokenizer
    a, b, c = tok.encode("one two three four"), tok.encode("five six seven"), tok.encode("eight nine")
    engine = _engine(lm, parallel=2, cache_slots=2)
    try:
        (ea,), _ = _run(engine, [_spec(a, 8)])
        turn2 = a + [e[0] for e in ea] + tok.encode(" ten")  # a chat's next turn resends its history
        (e2,), (s2,) = _run(engine, [_spec(turn2, 8)])
        assert s2.cached_prompt_tokens == len(a) + len(ea) - 1  # the last reply token was never fed
        assert e2 == _alone(lm, _spec(turn2, 8))
        (e3,), (s3,) = _run(engine, [_spec(turn2, 8)])  # the same prompt again: from its kept logits
        assert s3.cached_prompt_tokens == len(turn2) and e3 == e2
        _run(engine, [_spec(b, 4)])  # the second slot
        stats = engine.slots.stats
        assert (stats.hits, stats.misses, stats.evictions) == (2, 2, 0)
        (ec,), (sc,) = _run(engine, [_spec(c, 4)])  # both slots hold tokens: the LRU one (turn2's) goes
        assert sc.cached_prompt_tokens == 0 and stats.evictions == 1 and ec == _alone(lm, _spec(c, 4))
        (e2b,), (s2b,) = _run(engine, [_spec(turn2, 8)])
        assert s2b.cached_prompt_tokens == 0 and e2b == e2  # evicted: prefilled again, the same reply

        async def shared_prefix():  # a second client with the same start while the first still runs
            first = engine.submit(**_spec(a + tok.encode(" x y"), 40))
            stream = engine.stream(first)
            await stream.__anext__()
            second = engine.submit(**_spec(a + tok.encode(" z"), 6))
            got = await _collect(engine, second)
            async for _ in stream:
                pass
            return got, second.stats
        got, s = asyncio.run(shared_prefix())
        assert s.cached_prompt_tokens >= len(a) - 1 and got == _alone(lm, _spec(a + tok.encode(" z"), 6))
    finally:
        engine.close()


def test_cancelled_request_frees_its_slot_at_once(lm):
    tok = lm.tokenizer
    engine = _engine(lm, parallel=2)
    short = _spec(tok.encode("short one"), 10)
    try:
        async def go():
            long_job = engine.submit(**_spec(tok.encode("a long reply"), CTX - 10))
            short_job = engine.submit(**short)
            stream = engine.stream(long_job)
            await stream.__anext__()
            long_job.cancel()
            rest = [e async for e in stream]
            return rest, long_job.stats, await _collect(engine, short_job)
        rest, stats, short_events = asyncio.run(go())
        assert stats.completion_tokens < CTX // 2 and len(rest) < CTX // 2
        assert short_events == _alone(lm, short)
        deadline = time.monotonic() + 10
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.running == 0 and not any(engine.slots.busy)
    finally:
        engine.close()


def test_structured_outputs_inside_a_batch(lm):
    pytest.importorskip("llguidance")
    from hotcold.server.constrain import compile_json

    tok = lm.tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    grammar = compile_json(tok, lm.config.vocab_size, schema)
    prompts = [tok.encode(t) for t in ("json please", "another", "free text here")]
    sampling = SamplingParams(temperature=0.7)
    specs = lambda: [_spec(prompts[0], 30, sampling, seed=1, constraint=grammar.matcher(), ignore_eos=False),  # noqa: E731
                     _spec(prompts[1], 30, sampling, seed=2, constraint=grammar.matcher(), ignore_eos=False),
                     _spec(prompts[2], 20)]
    refs = [_alone(lm, s) for s in specs()]
    engine = _engine(lm, parallel=3)
    try:
        events, _ = _run(engine, specs())
    finally:
        engine.close()
    assert events == refs and max(engine.sizes) > 1
    for ev in events[:2]:
        assert ev[-1][2] == "stop" and "".join(e[1] for e in ev).startswith("{")


@pytest.mark.slow
def test_smollm2_requests_in_a_batch_equal_each_alone(smollm2_path):
    lm = load_model(smollm2_path, "cpu")
    tok = lm.tokenizer
    specs = [_spec(tok.encode(t), n) for t, n in (("Once upon a time", 24), ("The capital of France is", 12),
                                                  ("def fibonacci(n):", 20), ("Dear Sir or Madam,", 16))]
    refs = [_alone(lm, s) for s in specs]
    engine = _engine(lm, parallel=4)
    try:
        events, _ = _run(engine, specs)
    finally:
        engine.close()
    assert events == refs and max(engine.sizes) == 4
