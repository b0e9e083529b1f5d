"""hotcold.planner: where each layer's units run.

probe.py    measures this machine (once per host, cached) -> HardwareProfile
hardware.py HardwareProfile, the presets of other machines, the cached profile files
inputs.py   per-layer access frequencies from profile.safetensors / profile.json (or --uniform)
costs.py    the cost model (all constants in `Constants`): bytes and seconds of every unit
evaluate.py a placement and its `evaluate` under the cost model
ilp.py      the PuLP MILP (CBC or HiGHS); greedy.py the hottest-first baseline
make.py     modes, budgets and errors, plan.json contents; plan.py the artifact's read/write
command.py  `hotcold probe` and `hotcold plan`
"""
