"""tools/bench.py in parts: common, offload, inputs, children, report."""
