"""The synthetic edit workload of `retouch bench throughput` and `retouch bench serving`: the editor
they share (model, host cache, planner), template images, rectangular masks on the latent token grid
with mask ratios from the paper's distributions, and Poisson arrivals.

Mask ratios follow `retouch.engine.simulate.MASK_BETA` (public: Beta(1.9, 8.1), mean 0.19; production:
Beta(1.1, 8.9), mean 0.11). A mask is one rectangle of whole tokens at a random place, so the
editor's token mask of it is exactly the rectangle and its ratio is known without rasterising.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from retouch.bench import stock
from retouch.bench.report import DTYPE_CHOICES, MAX_SIDE, cost_model_arg, device_arg, out_path, positive_float, seed_arg
from retouch.cache import CacheFull, CacheStore, StoreConfig
from retouch.editor import PATCH_STRIDE, EditRequest, MaskAwareEditor
from retouch.errors import InputError
from retouch.engine.simulate import MASK_BETA
from retouch.models import get_spec
from retouch.models.loading import load_for_bench
from retouch.models.registry import is_builtin
from retouch.progress import bar

GiB = 1 << 30
# Host cache budgets: flux-size at 1024 px records ~1.4 GB of Y-cache per step and template, so two
# templates of 8 steps need ~23 GB (the GPU machine has 128 GiB); tiny CPU models need kilobytes.
DEFAULT_HOST_GIB = {"cuda": 40.0, "cpu": 1.0}


@dataclass(frozen=True)
class SyntheticEdit:
    """One request of the workload and the tokens its mask covers."""

    request: EditRequest
    masked_tokens: int
    image_tokens: int

    @property
    def mask_ratio(self) -> float:
        return self.masked_tokens / self.image_tokens


def add_editor_options(parser: argparse.ArgumentParser) -> None:
    """The options both benchmarks build their editor and templates from (`load_editors`)."""
    parser.add_argument("--model", default="flux-size", help="built-in name or local diffusers pipeline folder")
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps of every template and edit")
    parser.add_argument("--size", type=int, default=None, help="template side in pixels (default: the model's)")
    parser.add_argument("--templates", type=int, default=2, help="templates the requests edit")
    parser.add_argument("--cache-mode", choices=("y", "kv"), default="y")
    parser.add_argument("--host-gib", type=positive_float, default=None,
                        help="pinned host cache budget (default: 40 on cuda, 1 on cpu)")
    parser.add_argument("--cost-model", type=cost_model_arg, default=None,
                        help="a `retouch profile` JSON: the planner chooses cache or compute per block")
    parser.add_argument("--planner", choices=("optimal", "algorithm1"), default="optimal")
    parser.add_argument("--seed", type=seed_arg, default=0)
    stock.add_options(parser)
    parser.add_argument("--out", type=out_path, default=None, help="also write the JSON here, and a PNG beside it")


def check_editor_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills in `args.size` and `args.dtype`; parser.error on values no run can use."""
    if not (is_builtin(args.model) or Path(args.model).is_dir()):
        parser.error(f"--model {args.model!r} is neither a built-in model nor a pipeline folder")
    if args.size is None:
        if not is_builtin(args.model):
            parser.error("--size is required for a pipeline folder")
        args.size = get_spec(args.model).resolution
    if not 32 <= args.size <= MAX_SIDE or args.size % PATCH_STRIDE:
        parser.error(f"--size must be a multiple of {PATCH_STRIDE} in [32, {MAX_SIDE}], got {args.size}")
    if args.steps < 1 or args.templates < 1:
        parser.error("--steps and --templates must be >= 1")
    if args.host_gib is not None and args.host_gib <= 0:
        parser.error("--host-gib must be > 0")
    device_type = torch.device(args.device).type
    args.dtype = args.dtype or ("bfloat16" if device_type == "cuda" else "float32")


def devices_for(device: str, workers: int) -> list[torch.device]:
    """One device per worker: cuda:0..workers-1 for "cuda"; a named device or the CPU only for one."""
    device = torch.device(device)
    if workers == 1:
        return [device]
    if device.type != "cuda" or device.index is not None:
        raise ValueError(f"{workers} workers need one GPU each: pass --device cuda, not {device}")
    if workers > torch.cuda.device_count():
        raise ValueError(f"{workers} workers but {torch.cuda.device_count()} GPUs")
    return [torch.device("cuda", index) for index in range(workers)]


def load_editor(args: argparse.Namespace, device: torch.device) -> MaskAwareEditor:
    """The model on `device` behind a mask-aware editor whose templates live in a pinned host
    `CacheStore`; with `--cost-model` the planner picks cache or compute per block and batch, with
    `--compile` its mask-aware blocks run compiled."""
    host_gib = args.host_gib or DEFAULT_HOST_GIB.get(device.type, DEFAULT_HOST_GIB["cpu"])
    print(f"loading {args.model} on {device} ({args.dtype}), host cache {host_gib:g} GiB", file=sys.stderr)
    model = load_for_bench(args.model, device=device, dtype=getattr(torch, args.dtype))
    cost_model = load_cost_model(args.cost_model, model.name)
    return MaskAwareEditor(model, cache=CacheStore(StoreConfig(host_bytes=int(host_gib * GiB))),
                           cache_mode=args.cache_mode, cost_model=cost_model, planner=args.planner,
                           compile=args.compile, cuda_graphs=args.cuda_graphs)


def load_cost_model(path: Path | None, model: str):
    """The planner's cost model at `path` (None: no planner); refused unless profiled on `model`."""
    if path is None:
        return None
    from retouch.costs import CostModel

    cost_model = CostModel.from_json(path)
    if cost_model.model != model:
        raise InputError(f"--cost-model {path} was profiled on {cost_model.model}, not {model}")
    return cost_model


def register_templates(editor: MaskAwareEditor, args: argparse.Namespace) -> list[str]:
    """`args.templates` synthetic templates of `args.size` px, all held in host memory at once (an
    eviction would make an edit record its template again, inside the timed region)."""
    rng = np.random.default_rng(args.seed)
    template_ids = []
    for index in bar(range(args.templates), f"register templates ({args.steps} steps, {args.size}px, {editor.device})",
                     unit="template"):
        try:
            template_ids.append(editor.register_template(template_image(rng, args.size), prompt=f"a scene {index}",
                                                         steps=args.steps, seed=index))
        except CacheFull as exc:
            raise CacheFull(f"{exc}; raise --host-gib") from None
    store = editor.cache
    if not all(store.contains(template_id) for template_id in template_ids):
        raise CacheFull(f"{args.templates} templates do not fit {store.config.host_bytes / GiB:g} GiB together; "
                        "raise --host-gib")
    return template_ids


def template_image(rng: np.random.Generator, size: int) -> Image.Image:
    """A flat colour with a few ellipses: something a VAE encodes to non-trivial latents."""
    image = Image.new("RGB", (size, size), _colour(rng))
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x, y = (int(v) for v in rng.integers(0, size, 2))
        draw.ellipse((x, y, x + size // 3, y + size // 4), fill=_colour(rng))
    return image


def token_stride(editor: MaskAwareEditor) -> int:
    """Pixels per token side of the grid the editor masks: a transformer's patch, a UNet's latent pixel."""
    return editor.pipe.vae_scale_factor if editor.is_unet else PATCH_STRIDE


def mask_ratios(rng: np.random.Generator, count: int, mask_dist: str, fixed: float | None = None) -> np.ndarray:
    """[count] target mask ratios: `fixed` for all, else drawn from the paper's `mask_dist`."""
    if fixed is not None:
        return np.full(count, fixed)
    return rng.beta(*MASK_BETA[mask_dist], count)


def rectangle_mask(rng: np.random.Generator, size: int, stride: int, ratio: float) -> tuple[Image.Image, int]:
    """A white rectangle of whole `stride`-pixel tokens covering about `ratio` of a `size` px square
    (at least one token), at a random place with a random aspect; returns it and its token count."""
    grid = size // stride
    target = min(grid * grid, max(1.0, ratio * grid * grid))
    height = max(1, min(grid, round(math.sqrt(target) * rng.uniform(0.7, 1.3))))
    width = max(1, min(grid, round(target / height)))
    top, left = int(rng.integers(0, grid - height + 1)), int(rng.integers(0, grid - width + 1))
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle((left * stride, top * stride, (left + width) * stride - 1,
                                    (top + height) * stride - 1), fill=255)
    return mask, height * width


def synthetic_edits(rng: np.random.Generator, template_ids: list[str], ratios: np.ndarray, size: int, stride: int,
                    first_seed: int = 0) -> list[SyntheticEdit]:
    """One edit per ratio, of a random template, with a rectangular mask and seed `first_seed + i`."""
    edits = []
    for index, ratio in enumerate(ratios):
        mask, masked = rectangle_mask(rng, size, stride, float(ratio))
        template_id = template_ids[int(rng.integers(0, len(template_ids)))]
        request = EditRequest(template_id, mask, f"edit {first_seed + index}", seed=first_seed + index)
        edits.append(SyntheticEdit(request, masked, (size // stride) ** 2))
    return edits


def poisson_arrivals(rng: np.random.Generator, count: int, rps: float) -> list[float]:
    """[count] ascending arrival offsets (s) of a Poisson process of rate `rps`; the first after one gap."""
    return np.cumsum(rng.exponential(1.0 / rps, count)).tolist()


def _colour(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(c) for c in rng.integers(0, 256, 3))
