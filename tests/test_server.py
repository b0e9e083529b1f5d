"""`hotcold serve` end to end: a real server on a loopback port with SmolLM2, driven by the
official openai client and by raw HTTP for the error cases, plus a bounded load test."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
CTX = 512
MAX_CONCURRENCY = 8
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Server:
    base: str
    proc: subprocess.Popen
    log: Path
    loading_bodies: list = field(default_factory=list)  # /health answers seen before 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "hotcold.cli", *map(str, args)]


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the test machine's cores are shared
    cmd = _cli("serve", smollm2_path, "--port", port, "--api-key", API_KEY, "--ctx", CTX,
               "--max-concurrency", MAX_CONCURRENCY, "--device", "cpu")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready in time:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                r = httpx.get(srv.base + "/health", timeout=5)
                if r.status_code == 200:
                    break
                srv.loading_bodies.append((r.status_code, r.json()))
            time.sleep(0.2)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=60) as c:
        yield c


def _assert_error(r, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _metric(http, name: str, labels: str = "") -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait_idle(http, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = http.get("/health").json()
        if h["running"] == 0 and h["waiting"] == 0 or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


# -- health and models ------------------------------------------------------------------


def test_health_is_503_while_loading_then_200(server, http):
    assert server.loading_bodies, "never saw /health answer while the model loaded"
    status, body = server.loading_bodies[-1]
    assert status == 503 and set(body["error"]) == {"message", "type", "param", "code"}
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL and h["context_length"] == CTX
    assert h["max_concurrency"] == MAX_CONCURRENCY


def test_models_lists_the_served_model(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get(f"/v1/models/{MODEL}", headers=AUTH).json()["id"] == MODEL


# -- the openai client ----------------------------------------------------------------


def test_chat_completion_and_its_stream_agree(client):
    messages = [{"role": "user", "content": "Say hello."}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    choice = resp.choices[0]
    assert resp.id.startswith("chatcmpl-") and resp.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = resp.usage
    assert 0 < u.completion_tokens <= 6 and u.prompt_tokens > 5
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content and finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens


def test_completion_and_its_stream_agree(client):
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert resp.object == "text_completion" and resp.choices[0].text
    stream = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == resp.choices[0].text


def test_max_tokens_ends_with_length(client):
    resp = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=3, temperature=0)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to ten."}],
                                          max_completion_tokens=2, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 2


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), full
    resp = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stop=stop)
    assert resp.choices[0].text == full[: full.index(stop)] and resp.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0,
                                         stop=[stop, "never"], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sample(1234) == sample(1234)


def test_logprobs(client, http):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0, "logprobs": 1}
    lp = http.post("/v1/completions", json=body, headers=AUTH).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 2


# -- errors over raw HTTP -------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}

BAD_CHAT_FIELDS = [
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"stop": 5}, "stop"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": None}, "messages"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": 2}, "n"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
]


@pytest.mark.parametrize("fields,param", BAD_CHAT_FIELDS, ids=[json.dumps(f) for f, _ in BAD_CHAT_FIELDS])
def test_bad_chat_field_is_400(http, fields, param):
    _assert_error(http.post("/v1/chat/completions", json={**CHAT, **fields}, headers=AUTH), 400, param)


def test_malformed_json_and_non_object_bodies_are_400(http):
    for content in (b'{"messages": [', b"[1, 2]", b'"hi"', b""):
        r = http.post("/v1/chat/completions", content=content, headers={**AUTH, "Content-Type": "application/json"})
        _assert_error(r, 400)
    _assert_error(http.post("/v1/completions", json={"model": MODEL}, headers=AUTH), 400, "prompt")
    nan = json.dumps(CHAT)[:-1] + ', "temperature": NaN}'
    r = http.post("/v1/chat/completions", content=nan, headers={**AUTH, "Content-Type": "application/json"})
    _assert_error(r, 400, "temperature")


def test_prompt_over_the_context_is_400(http):
    body = {"model": MODEL, "prompt": "hello " * (CTX + 10), "max_tokens": 1}
    _assert_error(http.post("/v1/completions", json=body, headers=AUTH), 400, "prompt", "context_length_exceeded")
    body = {"model": MODEL, "prompt": [999999], "max_tokens": 1}
    _assert_error(http.post("/v1/completions", json=body, headers=AUTH), 400, "prompt")


def test_api_key_is_required(http):
    _assert_error(http.post("/v1/chat/completions", json=CHAT), 401, code="invalid_api_key")
    r = http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
    _assert_error(r, 401, code="invalid_api_key")
    _assert_error(http.get("/v1/models"), 401)


def test_unknown_routes_and_models_are_404(http):
    _assert_error(http.get("/v1/nothing", headers=AUTH), 404)
    _assert_error(http.post("/v2/chat/completions", json=CHAT, headers=AUTH), 404)
    _assert_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}, headers=AUTH), 404, "model",
                  "model_not_found")
    _assert_error(http.get("/v1/models/gpt-9", headers=AUTH), 404, "model")
    _assert_error(http.get("/v1/chat/completions", headers=AUTH), 405)


def test_unknown_fields_are_ignored(http):
    r = http.post("/v1/chat/completions", json={**CHAT, "user": "me", "frobnicate": {"x": 1}}, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


# -- concurrency ----------------------------------------------------------------------


def test_full_server_answers_429_and_disconnects_free_their_slots(http):
    before = _metric(http, "hotcold_completion_tokens_total")
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with contextlib.ExitStack() as streams:
        responses = [streams.enter_context(http.stream("POST", "/v1/completions", json=body, headers=AUTH))
                     for _ in range(MAX_CONCURRENCY)]
        assert all(r.status_code == 200 for r in responses)
        h = http.get("/health").json()
        assert h["running"] + h["waiting"] == MAX_CONCURRENCY and h["running"] <= h["parallel"] < MAX_CONCURRENCY
        _assert_error(http.post("/v1/chat/completions", json=CHAT, headers=AUTH), 429, code="rate_limit_exceeded")
        assert next(responses[0].iter_lines()).startswith("data: ")  # the first one streams; now all hang up
    h = _wait_idle(http)
    assert h["running"] == 0 and h["waiting"] == 0
    assert _metric(http, "hotcold_completion_tokens_total") - before < 400  # cut short, not run out
    assert http.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200


def test_non_streamed_request_stops_when_its_client_hangs_up(http):
    before = _metric(http, "hotcold_completion_tokens_total")
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, headers=AUTH, timeout=1.0)
    h = _wait_idle(http)
    assert h["running"] == 0 and h["waiting"] == 0
    assert _metric(http, "hotcold_completion_tokens_total") - before < 400


def test_load_many_clients_no_errors_no_leaked_slots(server, http):
    clients, per_client = 8, 20
    errors, done = [], []

    def worker(i: int) -> None:
        c = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        for j in range(per_client):
            try:
                if j % 2:
                    r = c.completions.create(model=MODEL, prompt=f"Client {i} says {j}", max_tokens=2, temperature=0)
                    ok = r.choices[0].finish_reason in ("stop", "length")
                else:
                    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Hi {i}.{j}"}],
                                                  max_tokens=2, temperature=0.7, seed=j)
                    ok = r.usage.completion_tokens <= 2
                (done if ok else errors).append(r)
            except Exception as e:  # noqa: BLE001 - every failure is counted
                errors.append(e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    wall = time.monotonic() - t0
    print(f"\nload: {len(done)} ok, {len(errors)} errors, {wall:.1f} s wall")
    assert not any(t.is_alive() for t in threads), "load test did not finish in time"
    assert errors == [] and len(done) == clients * per_client
    h = _wait_idle(http, 5)
    assert h["running"] == 0 and h["waiting"] == 0
    assert _metric(http, "hotcold_queue_depth") == 0 and _metric(http, "hotcold_requests_running") == 0


def test_metrics_are_exposed(http):
    text = http.get("/metrics").text
    assert re.search(r'^hotcold_requests_total\{endpoint="/v1/chat/completions",status="200"\} [1-9]', text, re.M)
    assert re.search(r'^hotcold_requests_total\{endpoint="/v1/chat/completions",status="400"\} [1-9]', text, re.M)
    for name in ("hotcold_prompt_tokens_total", "hotcold_completion_tokens_total",
                 "hotcold_time_to_first_token_seconds_count", "hotcold_decode_tokens_per_second_count",
                 "hotcold_batch_size_count", "hotcold_prefix_cache_hits", "hotcold_prefix_cache_reused_tokens"):
        assert _metric(http, name) > 0, name
    assert _metric(http, "hotcold_prefix_cache_misses") >= 1 and _metric(http, "hotcold_prefix_cache_evictions") >= 0


# -- startup failures -----------------------------------------------------------------


def test_missing_model_exits_2_with_one_line():
    r = subprocess.run(_cli("serve", "/no/such/path"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: /no/such/path")


def test_taken_port_exits_2_with_one_line(smollm2_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(_cli("serve", smollm2_path, "--port", port), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot listen" in r.stderr


def test_model_failing_to_load_ends_the_server_with_exit_2(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file" * 100)
    r = subprocess.run(_cli("serve", bad, "--port", "0"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {bad}")
