"""What the engine measures, per request and per worker (paper §6.4): where time goes and how often
the denoising loop is held up by work that is not denoising."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


def now() -> float:
    return time.perf_counter()


@dataclass
class RequestMetrics:
    """Timestamps of one request (perf_counter seconds) and its step count."""

    submitted: float = field(default_factory=now)
    admitted: float | None = None  # joined the running batch (its first step starts)
    denoised: float | None = None  # its last step ended
    completed: float | None = None  # its result was ready
    steps: int = 0
    admitted_step: int | None = None  # how many loop steps the worker had run when it joined
    tokens: int = 0  # image tokens of its canvas (a UNet's first level)
    computed_tokens: int = 0  # of them, those it computes per step: its masked ones, or all (a recording)
    deadline: float | None = None  # when it should be answered (this clock); None: no SLO
    lora_applied_step: int | None = None  # with a LoRA: the step (0-based) from which it applied

    @property
    def queue_s(self) -> float:
        return self.admitted - self.submitted

    @property
    def inference_s(self) -> float:
        return self.denoised - self.admitted

    @property
    def e2e_s(self) -> float:
        return self.completed - self.submitted

    @property
    def deadline_met(self) -> bool | None:
        """Whether it was answered by its deadline (on this worker's clock); None without one."""
        if self.deadline is None or self.completed is None:
            return None
        return self.completed <= self.deadline

    def to_json(self) -> dict:
        report = {"queue_s": self.queue_s, "inference_s": self.inference_s, "e2e_s": self.e2e_s,
                  "steps": self.steps, "tokens": self.tokens, "computed_tokens": self.computed_tokens}
        if self.deadline is not None:
            report["deadline_met"] = self.deadline_met
        if self.lora_applied_step is not None:
            report["lora_applied_step"] = self.lora_applied_step
        return report


HISTORY_STEPS = 100_000  # per-step samples kept (benchmarks read them); the totals cover the worker's whole life


@dataclass
class WorkerMetrics:
    """Per loop iteration that ran a step: its batch size, its wall time and the part of it spent in
    denoiser forwards; `interruptions` counts pre/post-processing tasks (and recordings of lost templates)
    the loop ran while other requests were mid-denoising. A worker runs for weeks: its summary comes from
    running totals, and only the last `history` steps' samples are kept."""

    history: int = HISTORY_STEPS
    steps: int = 0
    interruptions: int = 0
    completed: int = 0
    failed: int = 0  # edits
    failed_recordings: int = 0  # registrations, and the loop's own recordings of lost templates
    cancelled: int = 0
    recorded: int = 0  # templates recorded as members of the batch
    unrecorded: int = 0  # one-off images answered unrecorded: their recording did not fit the host cache
    recording_retries: int = 0  # registrations started over: templates in use held the host cache
    deferred_recordings: int = 0  # registrations left to their first edit: the caches were full (`Engine`)
    mixed_size_steps: int = 0  # steps whose forward packed requests of different image sizes (Flux, SD3)
    watch_errors: int = 0  # progress callbacks or previews that raised (the edits went on)
    last_watch_error: str | None = None
    total_step_s: float = 0.0
    total_batch_rows: int = 0
    total_overhead_s: float = 0.0  # the loop's own time (`record_step`)
    max_batch_size: int = 0

    def __post_init__(self):
        if self.history < 1:
            raise ValueError(f"history must be >= 1 step, got {self.history}")
        self.batch_sizes: deque[int] = deque(maxlen=self.history)
        self.step_s: deque[float] = deque(maxlen=self.history)
        self.forward_s: deque[float] = deque(maxlen=self.history)
        self.inline_s: deque[float] = deque(maxlen=self.history)

    def record_step(self, batch_size: int, step_s: float, forward_s: float, inline_s: float) -> None:
        """One step; its overhead is the loop's own time: admission, batch assembly, planning, scheduler
        updates and retirement (everything but forwards and inline pre/post work)."""
        self.steps += 1
        self.batch_sizes.append(batch_size)
        self.step_s.append(step_s)
        self.forward_s.append(forward_s)
        self.inline_s.append(inline_s)
        self.total_step_s += step_s
        self.total_batch_rows += batch_size
        self.total_overhead_s += max(0.0, step_s - forward_s - inline_s)
        self.max_batch_size = max(self.max_batch_size, batch_size)

    def mean_step_s(self) -> float:
        return self.total_step_s / self.steps if self.steps else 0.0

    def batch_sizes_since(self, mark: int) -> list[int]:
        """The batch sizes of the steps after the first `mark` (a count of `steps`), those still kept."""
        kept = list(self.batch_sizes)
        return kept[len(kept) - min(len(kept), max(0, self.steps - mark)):]

    def summary(self) -> dict:
        steps = self.steps
        return {
            "steps": steps, "completed": self.completed, "failed": self.failed,
            "failed_recordings": self.failed_recordings, "cancelled": self.cancelled,
            "recorded": self.recorded, "unrecorded": self.unrecorded, "recording_retries": self.recording_retries,
            "deferred_recordings": self.deferred_recordings, "mixed_size_steps": self.mixed_size_steps,
            "watch_errors": self.watch_errors,
            "interruptions": self.interruptions,
            "step_seconds": self.total_step_s, "batch_rows": self.total_batch_rows,
            "mean_batch_size": self.total_batch_rows / steps if steps else 0.0,
            "max_batch_size": self.max_batch_size,
            "mean_step_s": self.mean_step_s(),
            "mean_overhead_s": self.total_overhead_s / steps if steps else 0.0,
            "overhead_fraction": self.total_overhead_s / self.total_step_s if self.total_step_s else 0.0,
        }
