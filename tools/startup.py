"""Where the start-up of `hotcold run` goes: import, model header, load, numba cache, first token.

    python tools/startup.py [MODEL] [--repeats 3] [--tokens 3]

Runs the no-plan `hotcold run` path of MODEL (default: the embedded Gemma 3 270M) in fresh processes
and prints each stage's seconds: importing torch, importing hotcold's run path, reading the model's
header, loading it (open_for_run), the first token (prefill of a short prompt, with numba's cache
loads in it counted apart), and the later tokens. The best of --repeats runs is the machine's; the
spread shows how busy it is. A cold numba cache (a first run) shows as compile time in "cache".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from hotcold.executors.from_plan import open_for_run
from hotcold.models.generate import Generator
from hotcold.models.loader import default_model_path, describe_model
from hotcold.models.sampling import SamplingParams
from numba.core import caching
t2 = time.perf_counter()
spent = [0.0]
load_overload = caching.Cache.load_overload
def timed(self, *a, **k):
    s = time.perf_counter()
    try:
        return load_overload(self, *a, **k)
    finally:
        spent[0] += time.perf_counter() - s
caching.Cache.load_overload = timed
path = sys.argv[1] or default_model_path()
describe_model(path)
t3 = time.perf_counter()
setup = open_for_run(path, use_plan=False, device="cpu")
t4 = time.perf_counter()
loaded = spent[0]
gen = Generator(setup.lm)
it = gen.generate(setup.lm.tokenizer.encode("Hello"), int(sys.argv[2]), SamplingParams(temperature=0),
                  ignore_eos=True)
next(it)
t5 = time.perf_counter()
first = spent[0] - loaded
for _ in it:
    pass
t6 = time.perf_counter()
print(json.dumps({"import torch": t1 - t0, "import hotcold": t2 - t1, "header": t3 - t2, "load": t4 - t3,
                  "first token": t5 - t4, "of it numba cache": first, "later tokens": t6 - t5,
                  "to first token": t5 - t0}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=3)
    args = ap.parse_args()
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.tokens)], capture_output=True,
                             text=True)
        if out.returncode != 0:
            sys.exit(f"error: the run failed: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'stage':<20}" + "".join(f"{f'run {i + 1}':>9}" for i in range(len(runs))) + f"{'best':>9}")
    for key in runs[0]:
        vals = [r[key] for r in runs]
        print(f"{key:<20}" + "".join(f"{v:9.2f}" for v in vals) + f"{min(vals):9.2f}")


if __name__ == "__main__":
    main()
