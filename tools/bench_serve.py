"""Load test of `hotcold serve`: N concurrent streaming clients, and a chat that resends its history.

    python tools/bench_serve.py                                   # SmolLM2 on the CPU, 1 and 8 clients
    python tools/bench_serve.py --clients 1,4,8 --requests 20
    python tools/bench_serve.py --server 'p1=--parallel 1' --server 'p8=--parallel 8'   # side by side
    python tools/bench_serve.py --server 'before=@/tmp/before' --server 'after='        # an older checkout
    python tools/bench_serve.py --llama-server ~/llama.cpp/build/bin/llama-server     # against llama-server

Each --server NAME=ARGS starts `hotcold serve MODEL ARGS` on a free port (ARGS starting with
@DIR: run the hotcold package found in DIR, laid out as installed: DIR/hotcold holds a checkout's
hotcold/*.py and links to its executors, models, planner, predictors, profiler, server and
sparse_ops folders; check with `PYTHONPATH=DIR python -c "import hotcold.server; print(hotcold.server)"`), waits for /health and one warm-up request (numba compiles on first use), runs every scenario against it, and stops it; servers run one
after the other, scenarios alternate between them when --rounds > 1 (the machine's noise falls
on both alike). A scenario of C clients sends C x --requests streamed completions (each client one
at a time, max_tokens drawn from --tokens, ignore_eos so every reply is that long) through the
openai client without retries (a 429 counts as an error, not as a hidden back-off) and reports
the aggregate rate (completion tokens / wall time), p50/p95/max latency, p50/p95 time to first
token and p95 time per output token. The chat scenario sends a conversation of --turns turns,
each resending the whole history, and reports each turn's time to first token and the prompt
tokens the server reports as cached.

--llama-server BIN adds llama.cpp's own server as the first server (the peer the ratios divide
by), started as `BIN -m MODEL --port P --parallel N -t T -c CTX --cont-batching --cache-reuse 256`
(--llama-args replaces everything after the port), so it serves N slots with continuous batching
and per-slot prompt caches, as llama.cpp users run it for several clients. Where a server's stream
reports no usage, a reply's tokens are its streamed text chunks (one token each in both servers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TOPICS = ["a lighthouse", "the moon", "a lost key", "rain in spring", "an old map", "a red bicycle", "the ocean",
          "a quiet library", "a dragon", "coffee", "a train at night", "mountains", "a small robot", "autumn leaves"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Server:
    """`hotcold serve MODEL ARGS` (or, with `llama`, `llama-server -m MODEL ARGS`) as a subprocess on a
    free port, its log in a temp file."""

    def __init__(self, name: str, model: str, args: str, llama: str | None = None):
        self.name, self.port = name, _free_port()
        env = dict(os.environ)
        if args.startswith("@"):
            where, _, args = args[1:].partition(" ")
            env["PYTHONPATH"] = where + os.pathsep + env.get("PYTHONPATH", "")
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench_serve_{name}_", suffix=".log", delete=False)
        if llama:
            cmd = [llama, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "--alias", "m", *args.split()]
        else:
            cmd = [sys.executable, "-c", "from hotcold.cli import main; main()", "serve", model, "--port",
                   str(self.port), "--model-name", "m", *args.split()]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise SystemExit(f"server {self.name} exited; its log: {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    httpx.post(self.url + "/v1/completions", timeout=600,
                               json={"model": "m", "prompt": "Hello there, how", "max_tokens": 4})
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"server {self.name} not ready after {timeout_s} s; its log: {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _one(client, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, n, pieces = None, 0, 0
    stream = await client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            pieces += 1
            first = first or time.perf_counter()
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    n = n or pieces
    end = time.perf_counter()
    first = first or end
    return {"latency": end - t0, "ttft": first - t0, "tokens": n,
            "tpot": (end - first) / (n - 1) if n > 1 else float("nan")}


async def load(url: str, clients: int, requests: int, tokens: tuple[int, int], seed: int) -> dict:
    """C clients, each sending `requests` streamed completions one after the other."""
    from openai import AsyncOpenAI

    rng = random.Random(seed)
    plan = [[(f"Write a short story about {rng.choice(TOPICS)} (number {c}-{r}).", rng.randint(*tokens))
             for r in range(requests)] for c in range(clients)]
    results, errors = [], []

    async def client_loop(items):
        # a connection per request: llama-server closes a kept-alive connection after a few requests
        # (a reused one then fails as a connection error), so neither server keeps one
        client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600,
                             http_client=httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=600))
        for prompt, n in items:
            try:
                results.append(await _one(client, prompt, n))
            except Exception as e:  # counted, not retried
                errors.append(f"{type(e).__name__}: {e}")
        await client.close()

    warm = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    await _one(warm, "Hello", 2)  # untimed: the openai client's first streamed request imports its parts (~2 s)
    await warm.close()
    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(items) for items in plan))
    wall = time.perf_counter() - t0
    lat = [r["latency"] for r in results]
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] == r["tpot"]]
    total = sum(r["tokens"] for r in results)
    return {"clients": clients, "ok": len(results), "errors": len(errors), "first_error": errors[:1],
            "tokens": total, "wall_s": wall, "tok_per_s": total / wall,
            "latency_p50": _percentile(lat, 0.5), "latency_p95": _percentile(lat, 0.95), "latency_max": max(lat or [0]),
            "ttft_p50": _percentile(ttft, 0.5), "ttft_p95": _percentile(ttft, 0.95),
            "tpot_p50": _percentile(tpot, 0.5), "tpot_p95": _percentile(tpot, 0.95)}


async def chat(url: str, turns: int, reply_tokens: int) -> list[dict]:
    """One conversation resending its history each turn: TTFT and cached prompt tokens per turn."""
    messages = [{"role": "system", "content": "You are a helpful assistant who answers at length."}]
    out = []
    for t in range(turns):  # a connection per turn, as in `load`
        messages.append({"role": "user", "content": f"Tell me about {TOPICS[t % len(TOPICS)]}, part {t + 1}."})
        body = {"model": "m", "messages": messages, "max_tokens": reply_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        t0, first, text, usage = time.perf_counter(), None, "", {}
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        first = first or time.perf_counter()
                        text += chunk["choices"][0]["delta"]["content"]
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        messages.append({"role": "assistant", "content": text})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        out.append({"turn": t + 1, "ttft": (first or time.perf_counter()) - t0,
                    "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached})
    return out


def main() -> None:
    from conftest import smollm2_gguf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model to serve (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--server", action="append", default=None, metavar="NAME=ARGS",
                    help="a server to start with these extra serve arguments (repeatable; default: one, 'serve=')")
    ap.add_argument("--clients", default="1,8", help="comma-separated client counts")
    ap.add_argument("--requests", type=int, default=20, help="requests per client")
    ap.add_argument("--tokens", default="16,32", help="max_tokens drawn from this range (ignore_eos)")
    ap.add_argument("--turns", type=int, default=6, help="turns of the chat scenario (0: none)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every scenario this many times, alternating servers")
    ap.add_argument("--llama-server", metavar="BIN", help="also run llama.cpp's llama-server (first: the ratios' base)")
    ap.add_argument("--llama-args", default=None,
                    help="llama-server arguments after the port (default: --parallel N -t T -c CTX --cont-batching "
                         "--cache-reuse 256, N the most clients, T the CPUs, CTX 1024 a slot)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results here too")
    a = ap.parse_args()
    model = a.model or str(smollm2_gguf())
    tokens = tuple(int(x) for x in a.tokens.split(","))
    specs = [s.partition("=")[::2] for s in (a.server or ["serve="])]
    servers = [Server(name, model, args) for name, args in specs]
    if a.llama_server:
        n = max(int(x) for x in a.clients.split(","))
        largs = a.llama_args or f"--parallel {n} -t {os.cpu_count()} -c {1024 * n} --cont-batching --cache-reuse 256"
        servers.insert(0, Server("llama.cpp", model, largs, llama=a.llama_server))
        specs.insert(0, ("llama.cpp", largs))
    results: dict[str, list] = {name: [] for name, _ in specs}
    try:
        for s in servers:
            s.wait_ready()
        for rnd in range(a.rounds):
            for c in (int(x) for x in a.clients.split(",")):
                for s in servers:
                    r = asyncio.run(load(s.url, c, a.requests, tokens, a.seed + rnd))
                    r.update(server=s.name, round=rnd)
                    results[s.name].append(r)
                    print(f"{s.name:>10} clients={c:<2} ok={r['ok']:<4} err={r['errors']:<3} "
                          f"{r['tok_per_s']:7.1f} tok/s  latency p50 {r['latency_p50']:6.2f} p95 {r['latency_p95']:6.2f} "
                          f"max {r['latency_max']:6.2f} s  ttft p50 {r['ttft_p50']:5.2f} p95 {r['ttft_p95']:5.2f} s  "
                          f"tpot p95 {1000 * r['tpot_p95']:6.1f} ms", flush=True)
                    if r["first_error"]:
                        print(f"{'':>10} first error: {r['first_error'][0][:200]}")
            if a.turns:
                for s in servers:
                    turns = asyncio.run(chat(s.url, a.turns, 24))
                    results[s.name].append({"chat": turns, "round": rnd})
                    print(f"{s.name:>10} chat ttft " + " ".join(f"{t['ttft']:.2f}" for t in turns) + " s; cached " +
                          " ".join(str(t["cached_tokens"]) for t in turns) + " of " +
                          " ".join(str(t["prompt_tokens"]) for t in turns), flush=True)
    finally:
        for s in servers:
            s.stop()
    if len(servers) > 1:  # ratios against the first server, per client count, median over rounds
        base = servers[0].name
        for s in servers[1:]:
            for c in (int(x) for x in a.clients.split(",")):
                pick = lambda name, key: statistics.median(r[key] for r in results[name] if r.get("clients") == c)  # noqa: E731
                print(f"{s.name} / {base}, {c} clients: tok/s x{pick(s.name, 'tok_per_s') / pick(base, 'tok_per_s'):.2f}, "
                      f"latency p95 x{pick(s.name, 'latency_p95') / pick(base, 'latency_p95'):.2f}")
    if a.json:
        tmp = a.json.with_suffix(a.json.suffix + ".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(a.json)


if __name__ == "__main__":
    main()
