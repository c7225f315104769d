"""The copy engine's staging (`retouch.cache.staging`): every batch row's unmasked rows of what a block reads
arrive exactly as the cache store holds them (decoded: fp8 entries with their own per-channel scales), for
one or several rows, templates and steps, equal or mixed token counts (packed), in every storage dtype. On a
GPU through the copy stream (and fp8 through the one-pass decode kernel), else the CPU's copy thread."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_device import TRITON_DEVICE
from retouch.cache import CacheStore, StoreConfig
from retouch.cache.staging import CopyEngine, LevelRows, RowSource, StagedActivations

BLOCKS, STEPS = 3, 2
HEADS, HEAD_DIM, HIDDEN = 2, 4, 8
# Activations a KV-cache recording keeps per block: the output, and keys and values per head.
SHAPES = {"out": (HIDDEN,), "k": (HEADS, HEAD_DIM), "v": (HEADS, HEAD_DIM)}
TOKENS = {"small": 6, "large": 10}  # tokens of each template (a mixed batch packs both)


def activation(template_id: str, step: int, block: int, name: str) -> torch.Tensor:
    seed = hash((template_id, step, block, name)) % (2 ** 31)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS[template_id], *SHAPES[name], generator=generator) * (1 + block)


def recorded_store(dtype: str) -> CacheStore:
    store = CacheStore(StoreConfig(host_bytes=4 << 20, dtype=dtype))
    for template_id in TOKENS:
        store.begin(template_id)
        for step in range(STEPS):
            for block in range(BLOCKS):
                for name in SHAPES:
                    store.put(template_id, step, block, name, activation(template_id, step, block, name))
        store.commit(template_id)
    return store


STORES = {dtype: recorded_store(dtype) for dtype in ("auto", "bfloat16", "float8_e4m3fn")}


@st.composite
def batches(draw):
    """Rows (template, step, unmasked tokens; or no template and nothing reused), and whether mixed."""
    mixed = draw(st.booleans())
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        template_id = draw(st.sampled_from(sorted(TOKENS))) if mixed else "large"
        tokens = TOKENS[template_id]
        if draw(st.integers(0, 5)) == 0:  # a row that records: it reads nothing
            rows.append((None, 0, tokens, []))
            continue
        reused = draw(st.lists(st.integers(0, tokens - 1), unique=True, max_size=tokens))
        rows.append((template_id, draw(st.integers(0, STEPS - 1)), tokens, sorted(reused)))
    if all(template_id is None for template_id, *_ in rows):
        rows[0] = ("large" if not mixed else "small", 1, TOKENS["large" if not mixed else "small"], [0])
    return mixed, rows


@settings(max_examples=60, deadline=None)
@given(batch=batches(), dtype=st.sampled_from(sorted(STORES)), names=st.sampled_from([("out",), ("k", "v"),
                                                                                      ("k", "v", "out")]))
def test_staged_rows_are_the_stores_rows(batch, dtype, names):
    mixed, rows = batch
    store = STORES[dtype]
    handles = {template_id: store.acquire(template_id) for template_id in TOKENS}
    try:
        sources = [None if template_id is None else RowSource(handles[template_id], step)
                   for template_id, step, _, _ in rows]
        num_tokens = tuple(tokens for _, _, tokens, _ in rows) if mixed else rows[0][2]
        level = LevelRows(num_tokens, tuple(torch.tensor(reused, dtype=torch.long) for *_, reused in rows))
        staged = StagedActivations(CopyEngine(TRITON_DEVICE, lookahead=2))
        reads = [(block, names) for block in range(BLOCKS)]
        staged.start(sources, [level], [0] * BLOCKS, reads, BLOCKS, torch.float32)
        with staged:
            for block in range(BLOCKS):
                staged.block_started(block)
                for name in names:
                    keys = [None if template_id is None else (template_id, step) for template_id, step, _, _ in rows]
                    like = torch.empty(0, *SHAPES[name], device=TRITON_DEVICE)
                    got = staged.read_rows(block, name, keys, like, list(num_tokens) if mixed else num_tokens)
                    assert got.dtype == torch.float32 and got.device.type == TRITON_DEVICE.type
                    got = got.cpu()
                    start = 0
                    for row, (template_id, step, tokens, reused) in enumerate(rows):
                        mine = got[start:start + tokens] if mixed else got[row]
                        start += tokens
                        assert mine.shape == (tokens, *SHAPES[name])
                        if template_id is None:
                            continue
                        expected = handles[template_id].read(step, block, name).float()
                        assert torch.equal(mine[reused], expected[reused]), (row, block, name)
    finally:
        for handle in handles.values():
            handle.release()


def test_the_gather_beside_compute_takes_a_bounded_grid(monkeypatch):
    """On CUDA the host-gather kernel gets a quarter of the SMs (unbounded, it filled every SM and the compute
    it overlapped waited for it: stop 52); off CUDA nothing is bounded; the bound reaches every gather."""
    from retouch import ops

    engine = CopyEngine(TRITON_DEVICE, lookahead=2)
    if TRITON_DEVICE.type == "cuda":
        assert engine.gather_blocks == max(1, torch.cuda.get_device_properties(0).multi_processor_count // 4)
    else:
        assert engine.gather_blocks == 0
    with pytest.raises(ValueError, match="gather_blocks must be >= 0"):
        CopyEngine("cpu", gather_blocks=-1)
    bounds = []
    gather = ops.gather_host_rows_
    monkeypatch.setattr(ops, "gather_host_rows_", lambda *args, **kwargs: bounds.append(kwargs["max_blocks"])
                        or gather(*args, **kwargs))
    store = STORES["auto"]
    handle = store.acquire("small")
    try:
        staged = StagedActivations(CopyEngine(TRITON_DEVICE, lookahead=2, gather_blocks=5))
        level = LevelRows(TOKENS["small"], (torch.tensor([0, 2, 3]),))
        staged.start([RowSource(handle, 0)], [level], [0] * BLOCKS, [(0, ("k", "v"))], BLOCKS, torch.float32)
        with staged:
            staged.block_started(0)
            got = staged.read_rows(0, "k", [("small", 0)], torch.empty(0, *SHAPES["k"], device=TRITON_DEVICE),
                                   TOKENS["small"])
            assert torch.equal(got.cpu()[0][[0, 2, 3]], handle.read(0, 0, "k").float()[[0, 2, 3]])
    finally:
        handle.release()
    assert bounds == [5, 5]
