"""retouch.bench: benchmarks that print one JSON object (and write a PNG beside `--out`).

    retouch bench NAME [options]      (NAME in BENCHMARKS below; `retouch bench NAME -h`)     (or python -m retouch.bench.NAME)

Imported as `retouch.bench`; the folder is mapped into the package by setup.py.
"""

BENCHMARKS = ("step", "block", "image", "flops", "fidelity", "attention", "planner", "copy", "overlap", "batching",
              "throughput", "serving", "serve", "overhead", "soak", "mixed", "lora")
