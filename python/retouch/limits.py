"""Limits the head checks before any model is loaded: this module imports nothing, so `retouch serve`'s
head process (router and HTTP API) does not load diffusers to know them."""

# The longest schedule asked of any sampler: far past what any sampler improves with (a few hundred), short
# of what a schedule's tables cost in memory (10^10 steps: a 75 GiB allocation, a MemoryError).
MAX_STEPS = 10_000
