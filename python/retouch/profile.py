"""`retouch profile`: measure a model's blocks and the host->device copy on one device, fit the linear
cost models the planner (per step) and the router (per request) read, and write them as JSON.

    retouch profile --model tiny-flux-fill --device cpu --out cost.json

For each kind of block (Flux double/single, SD3 joint, a UNet level) one representative block is
timed on its own, with the inputs it sees inside the denoiser, over token grids, batch sizes and mask
ratios: in full (no cache), and mask-aware in Y-cache and KV-cache mode with the recorded activations
already on the device (the compute of a cached block, without its load). Each latency is fitted
linearly on the work features of `retouch.costs.block_features` (tokens computed, K/V tokens,
attention pairs, rows), as the paper fits latency on FLOPs (§4.4, Fig. 11). The load model times the
copy engine's gather from a host arena to the device over byte sizes. R^2 of every fit is reported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from retouch import ops
from retouch.adapters import CacheMode, MaskAwareContext, UNetMaskAwareContext, patch_flux, patch_sd3, patch_unet
from retouch.bench.timing import seconds_of
from retouch.cache import InMemoryActivationCache
from retouch.config import ProfileOptions
from retouch.errors import RetouchError
from retouch.costs import FEATURES, CostModel, RequestTokens, block_features, fit_linear
from retouch.masks import UNET_LATENT_STRIDE, centred_token_rectangle, pixel_mask_of_tokens, token_mask
from retouch.models import build_denoiser, get_spec
from retouch.models.inputs import random_flux_inputs, random_sd3_inputs, random_unet_inputs
from retouch.progress import bar

VARIANTS = {"full": None, "y": CacheMode.Y_CACHE, "kv": CacheMode.KV_CACHE}
SD3_CLIP_TOKENS = 77  # SD3 puts the padded CLIP tokens before the T5 tokens
UNET_TEXT_TOKENS = 77


@dataclass
class Target:
    """A denoiser prepared for profiling: its adapter, block kinds and how to build inputs and contexts."""

    denoiser: torch.nn.Module
    adapter: object
    kinds: list[str]
    inputs: Callable[[int, int], dict]  # (batch, grid side) -> forward kwargs
    record_context: Callable  # (batch, grid side, cache) -> context
    edit_context: Callable  # (mode, batch, grid side, ratio, cache) -> context
    tokens: Callable[[str, int, float], RequestTokens]  # (kind, grid side, ratio) -> one row's tokens
    representative: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        for index, kind in enumerate(self.kinds):
            self.representative.setdefault(kind, index)

    def record(self, batch: int, side: int, device: torch.device, representative_only: bool = False):
        """One recording forward at (batch, grid side): the (args, kwargs) of each representative block
        and the template activations, on `device`: of every block, or with `representative_only` of the
        representative blocks alone (all that timing one block reads: a KV-cache recording of flux-size
        at 1024 px and batch 4 is ~19 GB of device memory for 57 blocks, ~0.7 GB for 2)."""
        inputs = self.inputs(batch, side)
        captured = capture_block_inputs(self, inputs)
        cache = (BlocksCache(self.representative.values(), device=device) if representative_only else
                 InMemoryActivationCache(device=device))
        with torch.inference_mode(), self.adapter.run(self.record_context(batch, side, cache)):
            self.denoiser(**inputs)
        return captured, cache

    def block_run(self, index: int, args: tuple, kwargs: dict, context) -> Callable[[], None]:
        """A call of block `index` on its captured arguments: in full when `context` is None, else
        mask-aware under it."""
        block = self.adapter.blocks[index]

        def run():
            with torch.inference_mode():
                if context is None:
                    block(*args, **kwargs)
                else:
                    with self.adapter.run(context):
                        block(*args, **kwargs)
        return run


class BlocksCache(InMemoryActivationCache):
    """An in-memory cache that keeps the activations of some blocks only (what a recording of the others
    puts is dropped)."""

    def __init__(self, blocks, device: torch.device | str = "cpu"):
        super().__init__(device=device)
        self.blocks = frozenset(blocks)

    def put(self, template_id, step, block, name, tensor):
        if block in self.blocks:
            super().put(template_id, step, block, name, tensor)


def build_target(model: str, device: torch.device, dtype: torch.dtype, narrow: bool = False,
                 text_tokens: int | None = None) -> Target:
    """`narrow`: the model's depth and block structure at a tiny width (`retouch.models.narrow`);
    `text_tokens`: the prompt's tokens (default: what the model's pipeline pads prompts to)."""
    spec = get_spec(model)
    denoiser = build_denoiser(model, device=device, dtype=dtype, narrow=narrow).eval()
    family = spec.family
    if family in ("flux-fill", "flux-inpaint", "sd3"):
        is_flux = family != "sd3"
        adapter = (patch_flux if is_flux else patch_sd3)(denoiser)
        max_sequence = int(spec.call_defaults.get("max_sequence_length", 512))
        num_text = max_sequence if is_flux else SD3_CLIP_TOKENS + max_sequence
        num_text = num_text if text_tokens is None else text_tokens
        kinds = list(adapter.block_kinds())

        def inputs(batch, side):
            if is_flux:
                return random_flux_inputs(denoiser, batch, (side, side), num_text, seed=0, device=device, dtype=dtype)
            raw = random_sd3_inputs(denoiser, batch, (side, side), num_text, seed=0)
            return {k: v.to(device, dtype) if torch.is_tensor(v) else v for k, v in raw.items()}

        def record_context(batch, side, cache):
            return MaskAwareContext.record([f"t{b}" for b in range(batch)], [0] * batch, num_text, side * side,
                                           cache, device=device)

        def edit_context(mode, batch, side, ratio, cache):
            masked = centred_token_rectangle((side, side), ratio)
            return MaskAwareContext.edit(mode, [masked] * batch, [f"t{b}" for b in range(batch)], [0] * batch,
                                         num_text, side * side, cache, device=device)

        def tokens(kind, side, ratio):
            masked = len(centred_token_rectangle((side, side), ratio))
            return RequestTokens(text=num_text, image=side * side, masked=masked)

        return Target(denoiser, adapter, kinds, inputs, record_context, edit_context, tokens)
    # UNets: a kind per level; the grid is that of the first level (latent pixels).
    adapter = patch_unet(denoiser)
    kinds = list(adapter.block_kinds())

    def unet_inputs(batch, side):
        raw = random_unet_inputs(denoiser, batch, (side * 8, side * 8), text_tokens or UNET_TEXT_TOKENS, seed=0)
        moved = {k: v.to(device, dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                 for k, v in raw.items() if k != "added_cond_kwargs"}
        if "added_cond_kwargs" in raw:
            moved["added_cond_kwargs"] = {k: v.to(device, dtype) for k, v in raw["added_cond_kwargs"].items()}
        moved["timestep"] = moved["timestep"].to(device)
        return moved

    def unet_mask(side, ratio):
        return pixel_mask_of_tokens(centred_token_rectangle((side, side), ratio), (side, side), UNET_LATENT_STRIDE)

    def unet_record(batch, side, cache):
        return UNetMaskAwareContext.record([f"t{b}" for b in range(batch)], [0] * batch, (side * 8, side * 8),
                                           adapter.num_levels, cache, device=device)

    def unet_edit(mode, batch, side, ratio, cache):
        return UNetMaskAwareContext.edit(mode, [unet_mask(side, ratio)] * batch, [f"t{b}" for b in range(batch)],
                                         [0] * batch, adapter.num_levels, cache, device=device)

    def unet_tokens(kind, side, ratio):
        level = int(kind.removeprefix("level"))
        grid = token_mask(unet_mask(side, ratio), UNET_LATENT_STRIDE * 2 ** level)
        return RequestTokens(text=0, image=grid.numel(), masked=int(grid.sum()), cross_keys=UNET_TEXT_TOKENS)

    return Target(denoiser, adapter, kinds, unet_inputs, unet_record, unet_edit, unet_tokens)


def capture_block_inputs(target: Target, inputs: dict) -> dict[int, tuple[tuple, dict]]:
    """The (args, kwargs) each representative block is called with in one forward of the denoiser."""
    captured, hooks = {}, []
    for index in target.representative.values():
        def keep(module, args, kwargs, index=index):
            captured.setdefault(index, (args, kwargs))
        hooks.append(target.adapter.blocks[index].register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.inference_mode():
            target.denoiser(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def fastest_seconds(run: Callable[[], None], repeats: int, device: torch.device) -> float:
    """The fastest of `repeats` timed runs after a warm-up: other load on the machine only ever adds
    time, so the minimum estimates the block's own cost best (and keeps the fits' R^2 meaningful)."""
    seconds_of(run, device)  # warm-up
    return min(seconds_of(run, device) for _ in range(repeats))


def profile_blocks(target: Target, opts: ProfileOptions, device: torch.device,
                   progress: bool = False) -> tuple[list, dict]:
    """Timed samples `{kind, variant, seconds, <features>}`, and bytes per token row per kind and name;
    with `progress`, a bar on stderr over the (grid, batch size) points."""
    samples, row_bytes = [], {}
    points = [(side, batch) for side in opts.values("grids", int) for batch in opts.values("batch_sizes", int)]
    timed = bar(points, "profile blocks", unit="point", show=progress)
    for side, batch in timed:
        timed.set_postfix_str(f"{side}x{side} tokens, batch {batch}", refresh=False)
        samples += _profile_point(target, opts, device, side, batch, row_bytes)
    return samples, row_bytes


def _profile_point(target: Target, opts: ProfileOptions, device: torch.device, side: int, batch: int,
                   row_bytes: dict) -> list[dict]:
    """The samples of one (grid side, batch size) point; its recording is freed on return, before the next
    point records (two points' recordings at once were a flux-size profile's peak of device memory)."""
    samples = []
    captured, cache = target.record(batch, side, device, representative_only=True)
    for kind, index in target.representative.items():
        args, kwargs = captured[index]
        if kind not in row_bytes:  # as the store keeps them (the model's dtype)
            recorded = {name: cache.get("t0", 0, index, name) for name in ("out", "k", "v")}
            row_bytes[kind] = {name: t[0].numel() * t.element_size() for name, t in recorded.items()}
        for ratio in opts.values("mask_ratios"):
            rows = [target.tokens(kind, side, ratio)] * batch
            for variant, mode in VARIANTS.items():
                if variant == "full" and ratio != opts.values("mask_ratios")[0]:
                    continue  # full compute does not depend on the mask
                context = None if mode is None else target.edit_context(mode, batch, side, ratio, cache)
                seconds = fastest_seconds(target.block_run(index, args, kwargs, context), opts.repeats, device)
                samples.append({"kind": kind, "variant": variant, "seconds": seconds, **block_features(rows, variant)})
    return samples


LOAD_REPEATS = 5  # copies take microseconds: more repeats cost nothing and keep noise out of the slope


LOAD_ROW_BYTES = 4096


def load_arena(opts: ProfileOptions) -> ops.HostArena:
    """The host memory the load timings copy from: the largest --load-mib (allocated before any block is
    timed, so that a size the machine cannot hold is refused at once)."""
    largest = int(max(opts.values("load_mib")) * (1 << 20))
    return ops.allocate_host_arena(largest + LOAD_ROW_BYTES, 256, True, "the largest --load-mib")


def profile_loads(opts: ProfileOptions, device: torch.device, arena: ops.HostArena,
                  progress: bool = False) -> list[dict]:
    """Seconds of the copy engine's host->device gather of `bytes` (rows of 4 KiB, one run of rows) out of
    `arena` (`load_arena`); with `progress`, a bar on stderr over the sizes."""
    samples = []
    row = LOAD_ROW_BYTES
    source = arena.tensor()
    sizes = bar(opts.values("load_mib"), "profile loads", unit="size", show=progress)
    for mib in sizes:
        rows = max(1, int(mib * (1 << 20)) // row)
        sizes.set_postfix_str(f"{rows * row / (1 << 20):.2f} MiB", refresh=False)
        staging = torch.empty((rows, row), dtype=torch.uint8, device=device)
        src_offsets = torch.arange(rows, dtype=torch.long) * row
        dst_rows = torch.arange(rows, dtype=torch.long)
        seconds = fastest_seconds(lambda: ops.gather_host_rows_(staging, source, src_offsets, dst_rows),
                                 max(opts.repeats, LOAD_REPEATS), device)
        samples.append({"bytes": float(rows * row), "seconds": seconds})
    return samples


def run_profile(opts: ProfileOptions, device: torch.device, dtype: torch.dtype, command: str,
                progress: bool = False) -> CostModel:
    """Profile `opts.model`, write the cost model to `opts.out` and return it. With `progress` (as
    `retouch profile` runs it), what is built and bars over the timed points and load sizes on stderr."""
    arena = load_arena(opts)
    if progress:
        print(f"building {opts.model} on {device} ({dtype})", file=sys.stderr)
    target = build_target(opts.model, device, dtype)
    samples, row_bytes = profile_blocks(target, opts, device, progress)
    compute = {}
    for kind in target.representative:
        compute[kind] = {}
        for variant in VARIANTS:
            rows = [s for s in samples if s["kind"] == kind and s["variant"] == variant]
            compute[kind][variant] = fit_linear(rows, "seconds", FEATURES)
    load = fit_linear(profile_loads(opts, device, arena, progress), "seconds", ("bytes",))
    if load.coef[0] <= 0:  # the planner would think bigger loads are free
        raise RetouchError(f"the load timings did not grow with bytes ({opts.load_mib} MiB); the machine was "
                           "too busy or the sizes too small: rerun with larger --load-mib or more --repeats")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    model = CostModel(model=opts.model, device=device_name, dtype=str(dtype).removeprefix("torch."),
                      block_kinds=tuple(target.kinds), compute=compute, row_bytes=row_bytes, load=load,
                      meta={"command": command, "torch": torch.__version__, "threads": torch.get_num_threads(),
                            "grids": opts.grids, "batch_sizes": opts.batch_sizes, "mask_ratios": opts.mask_ratios,
                            "samples": len(samples)})
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    model.to_json(opts.out)
    return model
