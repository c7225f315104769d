"""One profiled call per variant (torch.profiler): where a GPU's time goes, from the same run as the timings.

`traced(runs, device, out)` runs each variant once more under the profiler (after the timed runs, so it
is warm) and returns per variant:
- wall_ms: the call, from the host entering it to the device finishing it;
- device_busy_ms: the union of the device's kernel and copy intervals (streams that overlap count once);
- device_idle_share: 1 - busy / wall, the time the device waited for the host (launch overhead, host
  syncs, Python): what issue 16's host-overhead work is meant to remove; None on a CPU. The profiler
  slows the host down (microseconds per op), so this is an upper bound: the timed rows give the call's
  unprofiled time;
- kernels: device events (kernels, copies, memsets); host_ops: top-level aten and retouch ops issued;
- top: the five ops with the most device time (on a CPU: the top-level ops' CPU time), with their share.
Each variant's Chrome trace goes to `<out stem>_trace_<variant>.json.gz` (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import gzip
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

OP_NAMESPACES = ("aten::", "retouch::")
TOP = 5


def traced(runs: dict[str, Callable[[], None]], device: torch.device, out: Path | None) -> dict[str, dict]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    summaries = {}
    for name, run in runs.items():
        _synchronize(device)
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            run()
            _synchronize(device)
            wall_s = time.perf_counter() - started
        summaries[name] = summarize(prof.events(), wall_s, device)
        if out is not None:
            path = trace_path(out, name)
            plain = path.with_suffix("")  # the profiler writes JSON; it travels gzipped (a step: tens of MB)
            prof.export_chrome_trace(str(plain))
            with open(plain, "rb") as source, gzip.open(path, "wb") as target:
                shutil.copyfileobj(source, target)
            plain.unlink()
            summaries[name]["trace"] = path.name
    return summaries


def summarize(events, wall_s: float, device: torch.device) -> dict:
    on_device = [event for event in events if event.device_type == DeviceType.CUDA]
    busy_us = covered_us([(event.time_range.start, event.time_range.end) for event in on_device])
    host_ops = [event for event in events
                if is_top_level_op(event) and event.device_type == DeviceType.CPU]
    timed = on_device if device.type == "cuda" else host_ops
    per_name: dict[str, float] = {}
    for event in timed:
        us = event.time_range.elapsed_us() if device.type == "cuda" else event.cpu_time_total
        per_name[event.name] = per_name.get(event.name, 0.0) + us
    total_us = sum(per_name.values()) or 1.0
    top = sorted(per_name.items(), key=lambda item: -item[1])[:TOP]
    wall_ms = 1e3 * wall_s
    return {"wall_ms": round(wall_ms, 3),
            "device_busy_ms": round(busy_us / 1e3, 3) if device.type == "cuda" else None,
            "device_idle_share": round(max(0.0, 1 - busy_us / 1e3 / wall_ms), 4) if device.type == "cuda" else None,
            "kernels": len(on_device), "host_ops": len(host_ops),
            "top": [{"name": op[:120], "ms": round(us / 1e3, 3), "share": round(us / total_us, 4)} for op, us in top]}


def trace_path(out: Path, variant: str) -> Path:
    return out.with_name(f"{out.stem}_trace_{re.sub(r'[^A-Za-z0-9.]+', '-', variant)}.json.gz")


def covered_us(intervals: list[tuple[float, float]]) -> float:
    """The time at least one of `intervals` (start, end) covers."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def is_top_level_op(event) -> bool:
    """An aten or retouch op that no other such op called (the ops the host issued itself)."""
    if not event.name.startswith(OP_NAMESPACES):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(OP_NAMESPACES):
            return False
        parent = parent.cpu_parent
    return True


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
