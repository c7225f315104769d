"""Keep diffusers and transformers quiet while retouch builds, saves and loads pipelines.

Only known noise is dropped; every other warning (missing or unexpected weights in a folder, say)
still reaches the user. The noise on the normal path is:
- progress bars: "Loading pipeline components", transformers' "Loading weights", "Writing model shards";
- transformers' warning that torchvision is missing, logged when diffusers imports a pipeline module
  (it falls back to the PIL image processors, which inpainting pipelines never call);
- diffusers 0.42's "modules ... that should be kept in float32: []", logged on every ModelMixin.to()
  with a dtype because it tests `[] is not None` (the SDXL pipeline also triggers it on each call when
  its VAE has force_upcast).
Bars and logger filters are process-wide, so this sets them for the duration and restores them.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import diffusers.utils.logging as diffusers_logging
import transformers.utils.logging as transformers_logging

_NOISE_BY_LOGGER = {
    "transformers.utils.import_utils": "requires torchvision (not installed); falling back to",
    "diffusers.models.modeling_utils": "that should be kept in float32: []",
}


class DropMessage(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Within the block, diffusers and transformers draw no progress bars and log no known noise."""
    libraries = (diffusers_logging, transformers_logging)
    bars_were_on = [(library, library.is_progress_bar_enabled()) for library in libraries]
    filters = [(logging.getLogger(name), DropMessage(fragment)) for name, fragment in _NOISE_BY_LOGGER.items()]
    for library, _ in bars_were_on:
        library.disable_progress_bar()
    for logger, noise_filter in filters:
        logger.addFilter(noise_filter)
    try:
        yield
    finally:
        for logger, noise_filter in filters:
            logger.removeFilter(noise_filter)
        for library, was_on in bars_were_on:
            if was_on:
                library.enable_progress_bar()
