"""Progress bars of the long command-line jobs: `retouch edit`, `retouch profile` and the benchmarks.

Bars go to stderr because stdout is the job's answer (one JSON object for profile and every benchmark).
They are drawn whether or not stderr is a terminal, since a CI log should show how far a job got; but
in a log every redraw is a line of its own, so there a bar redraws at most every LOG_INTERVAL_S
seconds (and always once at the end). RETOUCH_PROGRESS=0 turns every bar off.

The Python API draws none: a job's function takes `progress` and the command line turns it on, and
loaded pipelines keep their diffusers bars off except within `pipeline_bar`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from tqdm import tqdm

ENV = "RETOUCH_PROGRESS"
TERMINAL_INTERVAL_S = 0.1  # tqdm's own default: a terminal redraws in place
LOG_INTERVAL_S = 10.0  # a ten-minute benchmark leaves about 60 lines in a CI log


def enabled() -> bool:
    """Whether bars are drawn at all: unless RETOUCH_PROGRESS is "0"."""
    return os.environ.get(ENV, "1").strip() != "0"


def bar_options(desc: str, unit: str = "it", show: bool = True) -> dict:
    """tqdm's keyword arguments for a retouch bar, also what a diffusers pipeline's bar takes."""
    stream = sys.stderr  # looked up per bar: pytest's capsys and contextlib.redirect_stderr replace it
    terminal = stream.isatty()
    return {"desc": desc, "unit": unit, "file": stream, "disable": not (show and enabled()), "leave": True,
            "mininterval": TERMINAL_INTERVAL_S if terminal else LOG_INTERVAL_S, "dynamic_ncols": terminal}


def bar(iterable: Iterable | None = None, desc: str = "", *, total: int | None = None, unit: str = "it",
        show: bool = True) -> tqdm:
    """A bar on stderr over `iterable` (or advanced by `.update()` up to `total`); `show=False` draws
    nothing, for callers that asked for silence."""
    return tqdm(iterable, total=total, **bar_options(desc, unit, show))


def advance(progress: tqdm) -> Callable[[int, int], None]:
    """An engine's `on_step(k, n)` that moves `progress` to step k of n (n: the request's denoiser calls,
    which a second-order sampler makes about twice as many of as it has steps)."""
    def on_step(k: int, n: int) -> None:
        if progress.total != n:
            progress.total = n
            progress.refresh()
        progress.update(k - progress.n)
    return on_step


def note(message: str) -> None:
    """A line on stderr that does not tear an open bar (it is redrawn below the line)."""
    tqdm.write(message, file=sys.stderr)


@contextmanager
def pipeline_bar(pipe, desc: str) -> Iterator[None]:
    """Within the block, the diffusers pipeline `pipe` draws its own bar over denoising steps, as a
    retouch bar; afterwards it is off again, as the loaders leave every pipeline."""
    pipe.set_progress_bar_config(**bar_options(desc, unit="step"))
    try:
        yield
    finally:
        pipe.set_progress_bar_config(disable=True)
