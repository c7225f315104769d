"""LoRA on the text encoders, where prompts are encoded: the helper processes, or the worker without them.

A request's prompt is encoded once, before its first step, so an adapter's text-encoder part cannot
arrive late as its denoiser part may (`retouch.lora.manager`): the process that encodes the prompt reads
it first (`read_text_encoder_lora`: the header alone for a file without one). Encoding is one request
at a time, so the adapters apply as forward hooks on the targeted linears for that call only, unmerged,
as PEFT's lora.Linear computes them: `y = W x + (B (A x)) * scaling * scale`, summed over the request's
adapters. The encoders' weights never change.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F

from retouch.lora.files import TextEncoderParts, file_identity, lora_path, read_text_encoder_lora
from retouch.lora.spec import LoraChoice, LoraError

# A request's text-encoder adapters: (parts of one file, the request's scale), skipping files without any.
TextEncoderUses = tuple[tuple[TextEncoderParts, float], ...]
# What one process (a helper, or a worker without helpers) keeps of text-encoder parts, on its encoders'
# device: a rank-128 part for SDXL's two encoders (q, k, v, out) is ~100 MiB in bf16, a rank-16 one
# ~12 MiB.
CACHE_BYTES = 256 << 20
CACHE_FILES = 256  # files remembered (broken ones and those without a part cost a few bytes each)


class TextEncoderLoras:
    """The text-encoder parts of --lora-dir's files for one pipeline, on its encoders' device, read on first
    use and kept, least recently used first out, within `max_bytes` and `max_files` (the part read last is
    kept whatever its size; a file replaced in the folder is read again: `file_identity`). Thread-safe:
    reads and lookups take turns (prompts are encoded one at a time anyway)."""

    def __init__(self, lora_dir: str, pipe, max_bytes: int = CACHE_BYTES, max_files: int = CACHE_FILES):
        self.lora_dir, self.pipe = lora_dir, getattr(pipe, "pipe", pipe)
        self.max_bytes, self.max_files = max_bytes, max_files
        self._parts: OrderedDict[tuple, TextEncoderParts | str] = OrderedDict()  # or why the file cannot apply
        self._bytes = 0  # of the parts kept
        self._lock = threading.Lock()
        self.reads = 0  # files whose data was read (a file without a text-encoder part costs its header only)

    def of(self, lora: LoraChoice) -> TextEncoderUses:
        """A request's adapters that adapt a text encoder, with their scales. `LoraError` for a file that
        cannot be read, as `read_text_encoder_lora` says."""
        uses = []
        for use in lora:
            parts = self._parts_of(use.name)
            if parts:
                uses.append((parts, use.scale))
        return tuple(uses)

    def _parts_of(self, name: str) -> TextEncoderParts:
        with self._lock:
            identity = file_identity(self.lora_dir, name)
            key = (name, identity)
            if key in self._parts:
                self._parts.move_to_end(key)
                parts = self._parts[key]
            else:
                try:
                    parts = read_text_encoder_lora(lora_path(self.lora_dir, name), name, self.pipe)
                    self.reads += bool(parts)
                    parts = {component: weights.to(getattr(self.pipe, component).device)
                             for component, weights in parts.items()}
                except LoraError as error:  # kept as words, so that every request of a broken file is not a read
                    parts = str(error)
                self._parts[key] = parts
                self._bytes += _nbytes(parts)
                while len(self._parts) > 1 and (self._bytes > self.max_bytes or len(self._parts) > self.max_files):
                    self._bytes -= _nbytes(self._parts.popitem(last=False)[1])
            if isinstance(parts, str):
                raise LoraError(parts)
            return parts

    @property
    def nbytes(self) -> int:
        """Bytes of the parts kept."""
        return self._bytes


def _nbytes(parts: TextEncoderParts | str) -> int:
    return 0 if isinstance(parts, str) else sum(weights.nbytes for weights in parts.values())


@contextmanager
def applied(pipe, uses: TextEncoderUses) -> Iterator[None]:
    """Inside, the pipeline's text encoders apply `uses` (every call, e.g. prompt and negative prompt)."""
    if not uses:
        yield
        return
    pipe = getattr(pipe, "pipe", pipe)
    by_linear: dict[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor, float]]] = {}
    for parts, scale in uses:
        for component, weights in parts.items():
            encoder = getattr(pipe, component)
            for path, module in weights.modules.items():
                by_linear.setdefault(encoder.get_submodule(path), []).append((module.A, module.B,
                                                                              module.scaling * scale))
    with ExitStack() as undo:
        for linear, factors in by_linear.items():
            undo.callback(linear.register_forward_hook(_adds(factors)).remove)
        yield


def _adds(factors: Sequence[tuple[torch.Tensor, torch.Tensor, float]]):
    def hook(module, args, output):
        x = args[0]
        for A, B, scaling in factors:
            output = output + F.linear(F.linear(x.to(A.dtype), A), B) * scaling
        return output
    return hook
