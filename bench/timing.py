"""Timing shared by the benchmarks: variants timed round-robin, so background load falls on all alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def seconds_of(run: Callable[[], None], device: torch.device) -> float:
    """Wall time of one call; on CUDA between events around it, after the device is idle."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def interleaved_medians(runs: dict[str, Callable[[], None]], repeats: int, device: torch.device,
                        progress=None) -> dict[str, float]:
    """Median seconds of each run, timed round-robin after one warm-up each. `progress`: a bar
    (`retouch.progress.bar`) advanced once per call, outside the timed region: len(runs) * (repeats + 1)."""
    for run in runs.values():
        seconds_of(run, device)
        _advance(progress)
    samples = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(seconds_of(run, device))
            _advance(progress)
    return {name: statistics.median(values) for name, values in samples.items()}


def _advance(progress) -> None:
    if progress is not None:
        progress.update()
