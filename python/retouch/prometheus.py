"""The Prometheus text exposition format (version 0.0.4) for the few metric kinds the server keeps:
counters and histograms with labels, and gauges computed when scraped.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    pairs = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        pairs.append(extra)
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value)) if value != int(value) else str(int(value))


class Counter:
    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()):
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self._values: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def inc(self, *labels: str, by: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + by

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter",
                *(f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in items)]


class Histogram:
    def __init__(self, name: str, help_text: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS):
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self.buckets = tuple(sorted(buckets))
        self._series: dict[tuple, list] = {}  # labels -> [bucket counts..., sum, count]
        self._lock = threading.Lock()

    def observe(self, value: float, *labels: str) -> None:
        with self._lock:
            series = self._series.setdefault(labels, [0] * len(self.buckets) + [0.0, 0])
            index = bisect.bisect_left(self.buckets, value)
            if index < len(self.buckets):
                series[index] += 1
            series[-2] += value
            series[-1] += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._series.items())
        for labels, series in items:
            cumulative = 0
            for bound, count in zip(self.buckets, series):
                cumulative += count
                bucket = _labels(self.label_names, labels, 'le="' + str(bound) + '"')
                lines.append(f"{self.name}_bucket{bucket} {cumulative}")
            bucket = _labels(self.label_names, labels, 'le="+Inf"')
            lines.append(f"{self.name}_bucket{bucket} {series[-1]}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, labels)} {_number(series[-2])}")
            lines.append(f"{self.name}_count{_labels(self.label_names, labels)} {series[-1]}")
        return lines


def gauge(name: str, help_text: str, samples: Iterable[tuple[dict[str, str], float]], kind: str = "gauge") -> list[str]:
    """A metric read at scrape time: `samples` are (labels, value) pairs."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        lines.append(f"{name}{_labels(list(labels), list(labels.values()))} {_number(value)}")
    return lines
