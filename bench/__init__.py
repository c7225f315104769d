"""retouch.bench: benchmarks that print one JSON object (and write a PNG beside `--out`).

    retouch bench step | flops | fidelity | attention | planner | copy | overlap [options]     (or python -m retouch.bench.NAME)

Imported as `retouch.bench`; the folder is mapped into the package by setup.py.
"""

BENCHMARKS = ("step", "flops", "fidelity", "attention", "planner", "copy", "overlap", "batching", "serve")
