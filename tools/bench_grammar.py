"""What constrained decoding costs: time per token decoding with a JSON schema beside free decoding, in one run.

    python tools/bench_grammar.py                      # SmolLM2 on the CPU, 2 threads
    python tools/bench_grammar.py MODEL --device cuda  # any model hotcold loads
    python tools/bench_grammar.py MODEL --device cuda --plan --threads 8   # by the model's plan (hybrid)
    python tools/bench_grammar.py --engines            # llguidance vs xgrammar on SmolLM2's and Gemma 3's tokenizers

The decode comparison alternates free and constrained runs of the same length (the free one with
ignore_eos, as long as the constrained reply) and prints the median time per token of each, their
ratio (median and fastest run), and the same with the mask computed in line instead of on the
worker thread. --engines
measures what chose the grammar engine: building its tokenizer, compiling a schema, and the mask
per token along a valid reply.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SCHEMA = {"type": "object", "properties": {
    "people": {"type": "array", "minItems": 8, "maxItems": 8, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "city": {"type": "string", "maxLength": 24}},
        "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}
PROMPT = "List eight people with their name, age and city as JSON."

ENGINE_SCHEMAS = {
    "person": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                                 "email": {"type": "string", "format": "email"}},
                "required": ["name", "age"]},
               {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"}),
    "order": ({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "qty", "price"]}},
        "status": {"enum": ["new", "paid", "shipped"]}}, "required": ["id", "items", "status"]},
        {"id": "ABC-1234", "items": [{"sku": "pen", "qty": 2, "price": 1.5}, {"sku": "ink", "qty": 1, "price": 7.25}],
         "status": "paid"}),
    "event": ({"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "when": {"type": "string", "format": "date-time"},
        "where": {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"lat": {"type": "number"},
                                                                                  "lon": {"type": "number"}},
                                                 "required": ["lat", "lon"]}]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}, "required": ["title", "when"]},
        {"title": "Launch", "when": "2025-01-02T10:00:00Z", "where": {"lat": 1.5, "lon": 2.25}, "tags": ["a", "b"]}),
    "json_object": ({"type": "object"}, {"a": [1, 2, {"b": "hello world"}], "c": None, "d": True}),
}


def bench_decode(args) -> None:
    from conftest import smollm2_gguf

    from hotcold.models.generate import Generator
    from hotcold.models.loader import load_model
    from hotcold.models.sampling import SamplingParams
    from hotcold.server.constrain import compile_json

    torch.set_num_threads(args.threads)
    if args.plan:  # the engine `hotcold run` builds from the model's plan (hybrid on CUDA)
        from hotcold.executors.from_plan import open_for_run

        lm = open_for_run(Path(args.model), device=args.device, threads=args.threads).lm
    else:
        lm = load_model(args.model or smollm2_gguf(), args.device)
    tok = lm.tokenizer
    gen = Generator(lm, max_context=2048)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]), add_special_tokens=False)
    greedy = SamplingParams(temperature=0.0)

    def per_token(constraint=None, n=args.tokens, ignore_eos=False) -> tuple[float, int]:
        for _ in gen.generate(ids, n, greedy, constraint=constraint, ignore_eos=ignore_eos):
            pass
        s = gen.stats
        return s.decode_s / max(s.completion_tokens - 1, 1), s.completion_tokens

    grammar = compile_json(tok, lm.config.vocab_size, SCHEMA)
    per_token(grammar.matcher(), 8)  # warm: kernels, the llguidance tokenizer
    runs = {"free": [], "schema": [], "schema, mask in line": []}
    n = args.tokens
    for _ in range(args.repeats):
        t, n = per_token(grammar.matcher(overlap=True))
        runs["schema"].append(t)
        runs["free"].append(per_token(None, n, ignore_eos=True)[0])
        runs["schema, mask in line"].append(per_token(grammar.matcher(overlap=False))[0])
    free = statistics.median(runs["free"])
    best = min(runs["free"])
    print(f"{Path(str(lm.path)).name} on {args.device}, {torch.get_num_threads()} threads, {n} tokens per run, "
          f"{args.repeats} alternating runs (the fastest run is the least disturbed by other work on the machine):")
    for name, times in runs.items():
        t, b = statistics.median(times), min(times)
        print(f"  {name:22s} median {t * 1e3:7.2f} ms/token {t / free:6.3f}x free   "
              f"fastest {b * 1e3:7.2f} ms/token {b / best:6.3f}x free")


def _engine_tokenizers():
    from conftest import gemma3_gguf, smollm2_gguf

    from hotcold.models.gguf_loader import open_gguf
    from hotcold.models.tokenizer import Tokenizer

    for name, path in (("SmolLM2-135M", smollm2_gguf()), ("Gemma-3-270M", gemma3_gguf())):
        gguf = open_gguf(path)
        yield name, Tokenizer.from_gguf_metadata(gguf.metadata), gguf.hf_config()["vocab_size"]


def _llguidance(tok, n_vocab, schema, ids):
    import llguidance

    from hotcold.server.constrain import JSON_OPTIONS

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=n_vocab, eos_token=sorted(tok.eos_ids))
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
    t_compile = time.perf_counter() - t0
    bits = torch.zeros((n_vocab + 31) // 32, dtype=torch.int32)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        times.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    return t_tok, t_compile, times


def _xgrammar(tok, n_vocab, schema, ids):
    import xgrammar as xgr

    t0 = time.perf_counter()
    enc = [""] * n_vocab
    for s, i in tok.backend.get_vocab(with_added_tokens=True).items():
        if i < n_vocab:
            enc[i] = s
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.backend.to_str())
    info = xgr.TokenizerInfo(enc, meta["vocab_type"], vocab_size=n_vocab, stop_token_ids=sorted(tok.eos_ids),
                             add_prefix_space=meta["add_prefix_space"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                        separators=(", ", ": "), strict_mode=False))
    t_compile = time.perf_counter() - t0
    bits = xgr.allocate_token_bitmask(1, n_vocab)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bits)
        times.append(time.perf_counter() - t0)
        assert m.accept_token(t)
    return t_tok, t_compile, times


def bench_engines(args) -> None:
    torch.set_num_threads(args.threads)
    print(f"{'tokenizer':13s} {'schema':12s} {'engine':10s} {'tokenizer':>10s} {'compile':>9s} {'mask p50':>9s} "
          f"{'p90':>8s} {'max':>8s}")
    for name, tok, n_vocab in _engine_tokenizers():
        for sname, (schema, value) in ENGINE_SCHEMAS.items():
            ids = tok.encode(json.dumps(value), add_special_tokens=False)  # separators ", " and ": "
            for ename, fn in (("llguidance", _llguidance), ("xgrammar", _xgrammar)):
                t_tok, t_c, times = fn(tok, n_vocab, schema, ids)
                times.sort()
                print(f"{name:13s} {sname:12s} {ename:10s} {t_tok * 1e3:8.0f}ms {t_c * 1e3:7.1f}ms "
                      f"{times[len(times) // 2] * 1e6:7.1f}us {times[int(0.9 * len(times))] * 1e6:6.0f}us "
                      f"{times[-1] * 1e6:6.0f}us", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="a GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plan", action="store_true", help="load MODEL by its plan (`hotcold plan`), as `run` does")
    p.add_argument("--tokens", type=int, default=160, help="most tokens per constrained run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--engines", action="store_true", help="compare llguidance and xgrammar instead")
    args = p.parse_args()
    (bench_engines if args.engines else bench_decode)(args)


if __name__ == "__main__":
    main()
