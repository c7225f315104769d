"""What every mask-aware adapter shares: the patched blocks in execution order, one active context at
a time, and restoring the blocks. Model adapters (flux.py, sd3.py, unet.py) subclass it."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch._dynamo
import torch.fx.experimental._config

from retouch import ops
from retouch.adapters.context import TokenLayout
from retouch.cache.staging import StagedActivations
from retouch.ragged import RaggedBatch, token_bucket


class MaskAwareAdapter:
    """Handle of a patched denoiser; `run(context)` makes the forwards inside it mask-aware.

    `blocks` are in execution order: a block's index is the `block` of its cache keys and its entry in
    a context's `block_plan`. One context at a time: an adapter serves one forward at a time, as the
    model itself does.
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], attention_backend: str = "auto"):
        if attention_backend not in ops.ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ops.ATTENTION_BACKENDS}, got {attention_backend!r}")
        self.blocks = list(blocks)
        self.attention_backend = attention_backend
        self._context = None
        self._memo: dict = {}  # what the blocks of the active context share (see memo)
        self._compiled: dict | None = None  # block core -> its torch.compile'd version (see compile)
        self._cuda_graphs = False
        self.token_bucket: Callable[[int], int] | None = None  # see pad_tokens
        self.lora_layers = None  # the denoiser's `retouch.lora.layers.LoraLayers`, once a LoRA serves on it
        # The copy engine gates its copies on compute reaching blocks (staged memory stays bounded).
        self._start_hooks = [block.register_forward_pre_hook(functools.partial(self._block_starts, index))
                             for index, block in enumerate(self.blocks)]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def block_kinds(self) -> tuple[str, ...]:
        """The kind of each block in execution order, as `retouch profile` fits one cost model per kind
        (`retouch.costs.CostModel.block_kinds`)."""
        raise NotImplementedError

    @property
    def active_context(self):
        return self._context

    @contextmanager
    def run(self, context) -> Iterator:
        """Denoiser forwards inside this `with` statement follow `context`."""
        if self._context is not None:
            raise RuntimeError("a mask-aware context is already active on this adapter")
        if context.block_plan is not None and len(context.block_plan) != self.num_blocks:
            raise ValueError(f"block_plan has {len(context.block_plan)} entries for {self.num_blocks} blocks")
        self.check_context(context)
        self._context = context
        self._memo = {}
        try:
            yield context
        finally:
            self._context = None
            self._memo = {}

    def memo(self, key, compute):
        """`compute()` once per key while the active context lasts: what every block of a forward
        would otherwise derive again (attention plans, gathered position tables)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def key_rows_like(self, hidden_states: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        """An empty `[0, heads, head_dim]` tensor of hidden_states' dtype and device: what a block's cache
        reads of keys and values are shaped by. Made once per forward (one op fewer per block)."""
        return self.memo(("key-rows", hidden_states.dtype, hidden_states.device, heads, head_dim),
                         lambda: hidden_states.new_empty((0, heads, head_dim)))

    def output_over_stale_rows(self, hidden_states: torch.Tensor, records: bool) -> torch.Tensor:
        """What a KV-cache block writes its computed rows into when nothing reads its other rows: its input
        itself, when an earlier such block of this forward made that tensor and no request of the batch
        `records` (a recording's copy may still be reading it); otherwise a copy. The copy of every hidden
        row per block was one op and a full read and write of the hidden states. This assumes that only the
        next block reads a block's output (true of the diffusers loops; a hook that kept block outputs, such
        as a first-block cache, would see them change)."""
        made = self._memo.get("stale-rows-output")
        if made is not None and made() is hidden_states and not records:
            return hidden_states
        out = hidden_states.contiguous().clone()
        self._memo["stale-rows-output"] = weakref.ref(out)
        return out

    def compile(self, cuda_graphs: bool = False, **options) -> None:
        """Run the blocks through torch.compile from now on: the tensor cores of masked blocks and the class
        forward of blocks that run in full (`options`: torch.compile's). Token counts and batch sizes are
        dynamic, sizes 0 and 1 included (torch >= 2.13, `SIZE_OBLIVIOUS`): one graph per core and cache mode
        serves every mask and batch composition after the first forwards of a batch of one and of more.

        `cuda_graphs`: inductor's CUDA graphs too (mode "reduce-overhead"), with the computed tokens padded
        to `retouch.ragged.token_bucket` sizes, so one graph is captured per batch size and bucket. Graphs
        are captured on CUDA devices only (elsewhere this is the padded compiled path)."""
        if cuda_graphs:
            options = {"mode": "reduce-overhead", **options}  # which turns inductor's size asserts off itself
            self.pad_tokens(token_bucket)
        elif "mode" not in options:  # torch.compile takes a mode or inductor options, not both
            options = {**options, "options": {**LEAN_INDUCTOR, **options.get("options", {})}}
        self._cuda_graphs = cuda_graphs
        self._compile_options = {"dynamic": True, **options}
        self._compiled = {}

    @property
    def compiling(self) -> bool:
        return self._compiled is not None

    @property
    def measured_attention(self) -> bool:
        """Whether attention may take `ops.plan_attention`'s measured choice, SDPA among it: not under CUDA
        graphs, whose cores must read device tensors alone. SDPA's compiled path reads the plan's host
        lengths, and inductor skips capturing a graph with a CPU input (silently: a launch-bound step again)."""
        return not self._cuda_graphs

    def core(self, function):
        """`function` (a block core: tensors and modules in, tensors out), compiled if `compile` was called."""
        if self._compiled is None:
            return function
        if function not in self._compiled:
            self._compiled[function] = _size_oblivious(torch.compile(function, **self._compile_options))
        return self._compiled[function]

    def pad_tokens(self, bucket: Callable[[int], int] | None) -> None:
        """Compute `bucket(T)` query tokens where a forward's masked blocks have T (`RaggedBatch.padded`:
        repeats of a computed token, which change no result), so that the cores see one shape per bucket:
        what CUDA graphs capture. None: no padding."""
        self.token_bucket = bucket

    def computed_batch(self, batch: RaggedBatch) -> RaggedBatch:
        """The tokens the masked blocks compute for `batch`: itself, or padded to its bucket."""
        if self.token_bucket is None:
            return batch
        return self.memo(("padded", id(batch)), lambda: batch.padded(self.token_bucket(batch.num_query_tokens)))

    def computed_layout(self, context) -> TokenLayout:
        """The index layout of `computed_batch(context.batch)` (a `MaskAwareContext`'s)."""
        if self.token_bucket is None:
            return context.layout
        return self.memo(("layout", id(context.batch)),
                         lambda: TokenLayout.from_batch(self.computed_batch(context.batch)))

    def by_size(self, context, unmodified: Callable, hidden_states: torch.Tensor,
                encoder_hidden_states: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A block the plan runs unmodified, in a mixed-resolution batch (image rows packed `[sum L_b, H]`,
        text `[B, P, H]`): the class forward once per image size, on `[B_s, L_s, H]` (its attention is
        within a request, so this is what each request gets alone) -> (text [B, P, H] or None, packed image).
        `unmodified(key, requests, image_rows, L_s)` runs it on the requests of one size: their indices, and
        their rows of the image matrix, request after request."""
        groups = self.memo(("by-size", id(context)), lambda: _size_groups(context, hidden_states.device))
        text_out = None
        image_out = torch.empty_like(hidden_states)
        for key, requests, image_rows, num_image in groups:
            if self.lora_layers is not None:
                with self.lora_layers.subset(key):  # the class forward sees these requests' rows only
                    text, image = unmodified(key, requests, image_rows, num_image)
            else:
                text, image = unmodified(key, requests, image_rows, num_image)
            image_out.index_copy_(0, image_rows, image.flatten(0, 1))
            if text is not None:
                if text_out is None:
                    text_out = torch.empty_like(encoder_hidden_states)
                text_out.index_copy_(0, requests, text)
        return text_out, image_out

    def check_context(self, context) -> None:
        """Model-specific checks of a context before it becomes active."""

    def row_layouts(self, context) -> list[tuple[int, ...]]:
        """Rows per batch entry of every packed `[T, in]` matrix the forward's linear layers see (what a
        per-row LoRA needs, `retouch.lora.layers`): a `MaskAwareContext`'s masked image tokens and query
        tokens, and in a mixed-resolution batch its image and joint matrices."""
        prefix = context.batch.prefix
        layouts = [context.image_counts, tuple(context.batch.query_counts())]
        if context.mixed:
            layouts += [context.image_lens, tuple(prefix + length for length in context.image_lens)]
        return layouts

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Forwards inside run the blocks uncompiled and unpadded (what a per-row LoRA runs on)."""
        compiled, bucket = self._compiled, self.token_bucket
        self._compiled, self.token_bucket = None, None
        try:
            yield
        finally:
            self._compiled, self.token_bucket = compiled, bucket

    def _block_starts(self, index: int, module, args) -> None:
        if index == 0 and self._cuda_graphs and self._compiled is not None:
            # One generation of inductor's CUDA graph trees per denoiser forward. Left to itself, every call
            # of a compiled core starts one (dynamo counts entries), and each overwrites the outputs of the
            # last: block i's output, the next block's input, would be gone.
            torch.compiler.cudagraph_mark_step_begin()
        context = self._context
        if context is not None and isinstance(context.cache, StagedActivations):
            context.cache.block_started(index)

    def needs_all_output_rows(self, context, block: int) -> bool:
        """Whether a KV-cache block must fill its unmasked output rows: the next block computes every
        token (so reads them), or it is the last block (its output is the final hidden state)."""
        return block == self.num_blocks - 1 or not context.uses_cache(block + 1)

    def unpatch(self) -> None:
        """Restore the blocks' class forwards."""
        for hook in self._start_hooks:
            hook.remove()
        for block in self.blocks:
            block.__dict__.pop("forward", None)


def _size_oblivious(compiled):
    """Traces with sizes of 0 and 1 treated like any other where torch allows it (`SIZE_OBLIVIOUS`: a
    one-token mask is no new graph) and equal sizes not assumed equal. The setting is applied by dynamo's
    compile-start callback, only while one of these functions runs: a call that compiles nothing costs two
    thread-local writes, where patching the config around every call cost ~30 us a block."""
    @functools.wraps(compiled)
    def call(*args, **kwargs):
        callbacks = torch._dynamo.callback_handler
        if _on_compile_start not in callbacks.start_callbacks:  # torch._dynamo.reset() clears them
            callbacks.register_start_callback(_on_compile_start)
            callbacks.register_end_callback(_on_compile_end)
        _tracing.inside = getattr(_tracing, "inside", 0) + 1
        try:
            return compiled(*args, **kwargs)
        finally:
            _tracing.inside -= 1
    return call


# Inductor's runtime checks of each call's sizes, strides, alignment and scalar ranges: dynamo's guards have
# checked them before the call, and each is a Python call (about 40 per Flux block): on this CPU they cost
# ~8% of a compiled forward's host time. vLLM compiles without them, as torch's reduce-overhead mode does.
LEAN_INDUCTOR = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}

# torch 2.11's inductor (the GPU machines' image) fails to lower some of the cores' slices and views when
# sizes are traced size-oblivious (LoweringException: KeyError 'unbacked_bindings', NotImplementedError
# View); 2.13 lowers them (2.12 is untested). Before 2.13 sizes 0 and 1 specialize, so a one-token mask
# and a batch of one are graphs of their own there: they compile once more, mid-serving.
SIZE_OBLIVIOUS = torch.__version__ >= "2.13"
_tracing = threading.local()  # .inside: nesting depth of _size_oblivious calls in this thread
# Settings applied by a start callback. Dynamo pairs start and end with one process-wide counter, so
# an end may run in another thread than its start: the stack is process-wide too.
_applied: list = []


def _on_compile_start(args) -> None:
    patch = None
    if getattr(_tracing, "inside", 0):
        patch = torch.fx.experimental._config.patch(backed_size_oblivious=SIZE_OBLIVIOUS, use_duck_shape=False)
        patch.__enter__()
    _applied.append(patch)


def _on_compile_end(args) -> None:
    patch = _applied.pop() if _applied else None
    if patch is not None:
        patch.__exit__(None, None, None)


def _size_groups(context, device: torch.device) -> list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor, int]]:
    """Per image size of a mixed-resolution context: (its requests, as a tuple and a tensor; their rows
    of the packed image matrix; its image tokens)."""
    by_length: dict[int, list[int]] = {}
    for request, length in enumerate(context.image_lens):
        by_length.setdefault(length, []).append(request)
    groups = []
    for length, requests in by_length.items():
        rows = torch.cat([torch.arange(context.image_offsets[r], context.image_offsets[r] + length) for r in requests])
        groups.append((tuple(requests), torch.tensor(requests, device=device), rows.to(device), length))
    return groups
