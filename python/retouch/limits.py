"""Limits the options check before any model is loaded. This module imports nothing, so that commands
that load no model (`retouch --help`, `keys`, `simulate`) do not import diffusers to know them."""

# The longest schedule asked of any sampler: far past what any sampler improves with (a few hundred), short
# of what a schedule's tables cost in memory (10^10 steps: a 75 GiB allocation, a MemoryError).
MAX_STEPS = 10_000
