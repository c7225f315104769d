"""The in-memory activation cache honours the ActivationCache contract."""

import pytest
import torch

from retouch.cache import InMemoryActivationCache


def test_put_copies_and_get_returns_it():
    cache = InMemoryActivationCache()
    out = torch.randn(16, 8)
    cache.put("t1", step=0, block=3, name="out", tensor=out)
    out.zero_()  # the caller reuses its buffer
    assert cache.get("t1", 0, 3, "out").abs().sum() > 0
    with pytest.raises(KeyError, match="template 't1', step 1, block 3"):
        cache.get("t1", 1, 3, "out")


def test_dtype_conversion_and_byte_accounting():
    cache = InMemoryActivationCache(dtype=torch.bfloat16)
    cache.put("a", 0, 0, "k", torch.randn(4, 8))
    cache.put("b", 0, 0, "k", torch.randn(2, 8))
    assert cache.get("a", 0, 0, "k").dtype == torch.bfloat16
    assert cache.nbytes("a") == 4 * 8 * 2 and cache.nbytes() == 6 * 8 * 2


def test_drop_forgets_only_that_template():
    cache = InMemoryActivationCache()
    cache.put("a", 0, 0, "out", torch.ones(2, 2))
    cache.put("b", 0, 0, "out", torch.ones(2, 2))
    cache.drop("a")
    cache.drop("never-seen")
    assert not cache.contains("a") and cache.contains("b")
