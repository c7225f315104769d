"""Limits the options check before any model is loaded. This module imports nothing, so that commands
that load no model (`retouch --help`, `keys`, `simulate`) do not import diffusers to know them."""

# The longest schedule asked of any sampler: far past what any sampler improves with (a few hundred), short
# of what a schedule's tables cost in memory (10^10 steps: a 75 GiB allocation, a MemoryError).
MAX_STEPS = 10_000

# The families whose pipelines run classifier-free guidance (an unconditional branch beside the conditional
# one, mixed after the denoiser): a negative prompt steers it, and an edit may take another guidance scale
# than its template's recording. Flux is guidance-distilled (guidance is an input of every block). Here so
# that the HTTP head, which loads no model, refuses what its workers would.
GUIDED_FAMILIES = ("sd3", "sdxl", "sd2")
