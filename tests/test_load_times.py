"""LoadTimes: the load's time per stage, as `run --stats` prints it and tools/bench.py records it."""

from __future__ import annotations

import time

from hotcold.models.load_times import LoadTimes


def test_stages_add_up_in_order_and_other_is_the_rest():
    t = LoadTimes()
    with t.stage("repack"):
        time.sleep(0.01)
    with t.stage("parse"):
        pass
    t.add("repack", 0.5)
    t.finish()
    d = t.as_dict()
    assert list(d) == ["parse", "repack", "other", "total"]  # STAGES order, then other and total
    assert d["repack"] >= 0.51 and d["total"] >= 0.01
    assert t.other_s == max(0.0, t.total_s - sum(t.stages.values()))
    assert t.line().startswith("load ") and "repack 0.5" in t.line() and t.line().count("\n") == 0


def test_open_for_run_times_each_stage_of_a_gguf_load(smollm2_path):
    from hotcold.executors.from_plan import open_for_run

    setup = open_for_run(smollm2_path, use_plan=False, device="cpu")
    try:
        d = setup.load_times.as_dict()
    finally:
        setup.close()
    assert {"parse", "build", "weights", "tokenizer", "repack"} <= set(d)
    # each value is rounded to the millisecond, so the sum may exceed the total by half a ms per value
    assert sum(v for k, v in d.items() if k != "total") <= d["total"] + 0.0005 * len(d) + 1e-9
