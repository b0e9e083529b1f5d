"""hotcold.planner: where each layer's units run.

probe.py    hardware profile (measured once per host, or presets) -> HardwareProfile
inputs.py   per-layer access frequencies from profile.safetensors / profile.json (or --uniform)
costs.py    the cost model (all constants in `Constants`) and `evaluate` of a placement
ilp.py      the PuLP MILP (CBC or HiGHS); greedy.py the hottest-first baseline
make.py     modes, budgets and errors, plan.json contents; plan.py the artifact's read/write
command.py  `hotcold probe` and `hotcold plan`
"""
