"""The stock baselines every speedup is quoted against, in one run: the unmodified denoiser eager, and under
torch.compile (whole model: the strongest stock configuration users pick over eager).

Each baseline is an `unpatched_twin` of the pipeline's (patched) denoiser: the stock class, sharing the
patched model's weights, so a flux-size baseline costs no second 24 GB copy on the device.

    --baselines eager,compiled   the stock variants timed (default: eager; eager,compiled with --compile)
    --compile                    retouch's side compiled too (the mask-aware blocks' cores)
    --cuda-graphs                and replayed as CUDA graphs (inductor's "reduce-overhead", computed tokens
                                 padded to buckets): what cuts the host's launches per step on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

import torch

from retouch.models import unpatched_twin

BASELINES = ("eager", "compiled")


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile", action="store_true",
                        help="compile retouch's mask-aware blocks (and time the compiled stock model by default)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="--compile, with the compiled blocks replayed as CUDA graphs (CUDA only)")
    parser.add_argument("--baselines", type=baselines_arg, default=None,
                        help="stock variants to time, comma-separated: eager, compiled "
                             "(default: eager; eager,compiled with --compile)")


def chosen(args: argparse.Namespace) -> tuple[str, ...]:
    """The baselines `args` asks for (`add_options`), eager first."""
    if args.baselines is not None:
        return args.baselines
    return ("eager", "compiled") if compiled(args) else ("eager",)


def cudagraph_skips(args: argparse.Namespace) -> int | None:
    """With `--cuda-graphs`, how many times inductor declined to capture a compiled core (a CPU input, a
    mutated input, ...: that core then runs launch by launch), said on stderr when any; else None."""
    if not args.cuda_graphs:
        return None
    from torch._dynamo.utils import counters

    skips = int(counters["inductor"]["cudagraph_skips"])
    if skips:
        print(f"CUDA graphs: inductor skipped capturing {skips} time(s); TORCH_LOGS=perf_hints says why",
              file=sys.stderr)
    return skips


def compiled(args: argparse.Namespace) -> bool:
    """Whether retouch's side runs compiled (`--compile`, or `--cuda-graphs`, which implies it)."""
    return args.compile or args.cuda_graphs


def baselines_arg(text: str) -> tuple[str, ...]:
    """argparse `type` of `--baselines`: names of BASELINES, comma-separated, in BASELINES' order."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or set(names) - set(BASELINES):
        raise argparse.ArgumentTypeError(f"takes {', '.join(BASELINES)}, comma-separated; got {text!r}")
    return tuple(name for name in BASELINES if name in names)


def denoisers(denoiser: torch.nn.Module, baselines: tuple[str, ...]) -> dict[str, torch.nn.Module]:
    """The stock denoiser per baseline, sharing `denoiser`'s weights (see the module docstring)."""
    twin = unpatched_twin(denoiser)
    return {name: torch.compile(twin) if name == "compiled" else twin for name in baselines}


@contextlib.contextmanager
def swapped(pipe, denoiser: torch.nn.Module) -> Iterator[None]:
    """`pipe` with `denoiser` as its transformer or UNet, restored after."""
    name = "unet" if getattr(pipe, "unet", None) is not None else "transformer"
    patched = getattr(pipe, name)
    pipe.register_modules(**{name: denoiser})
    try:
        yield
    finally:
        pipe.register_modules(**{name: patched})


def full_edits(editor, requests, denoiser: torch.nn.Module) -> None:
    """The unmodified pipeline's edits of `requests` as one static batch (`edit_many(..., full_compute=True)`)
    with `denoiser`, a stock baseline, as its denoiser."""
    with swapped(editor.pipe, denoiser):
        editor.edit_many(requests, full_compute=True)


def describe(baselines: tuple[str, ...], what: str = "the unmodified diffusers denoiser") -> dict[str, str]:
    """The report's `baselines` entry: what each baseline row ran."""
    return {name: f"{what}, eager" if name == "eager" else f"{what} under torch.compile (the whole module)"
            for name in baselines}
