"""Errors that reach a user: the message is one line that says what to fix."""

import argparse
import sys

EXIT_USAGE = 2


class RetouchError(Exception):
    """Bad input or an unusable environment; the CLI prints it as one line and exits with 2."""


class ModelError(RetouchError):
    """An unknown built-in name, or a folder that is not a loadable diffusers pipeline."""


class InputError(RetouchError):
    """An unreadable or inconsistent image, mask or prompt."""


class DefaultsShown(argparse.HelpFormatter):
    """Each option's default after its help, as "(default: X)", unless the help already speaks of its default
    (the CLI's options spell theirs, an on/off flag's as the flag that gives it) or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS))  # `in` took 0 too
        if not action.option_strings or "default" in text or unset or isinstance(action, argparse._HelpAction):
            return text
        return text + " (default: %(default)s)"


# What the options that many commands share mean, for those that give no help of their own.
COMMON_HELP = {
    "model": "the model to run (`retouch models` lists the built-in ones)",
    "device": "cpu, cuda or cuda:N",
    "dtype": "weights dtype",
    "steps": "denoising steps of every edit",
    "repeats": "timed repeats per point",
    "mask_ratio": "fraction of the image tokens each mask repaints",
    "mask_ratios": "fractions of the image tokens the masks repaint, one point each",
    "mask_dist": "distribution of the mask ratios: InstGenIE's public or production traces",
    "cache_mode": "y: blocks' cached outputs; kv: their cached keys and values",
    "planner": "how the planner chooses, per block, cached rows or full compute",
    "seed": "seeds the random inputs (images, masks, arrivals)",
    "batch": "requests in the batch",
    "batch_sizes": "batch sizes, one point each",
    "max_batch": "most requests a worker's batch holds",
    "requests": "requests to run",
    "templates": "templates the requests edit",
    "workers": "workers of the cluster",
    "mode": "batching: static (whole batches), naive (step-level, pre/post-processing inline) or disagg "
            "(step-level, pre/post-processing in helper processes)",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line naming the flag (exit 2), not the whole usage block above it;
    a `description` given as a module docstring is cut to its first paragraph (its first line would end
    mid-sentence); every option's default shows in --help (`DefaultsShown`)."""

    def add_argument(self, *args, **kwargs):
        """An option without a help of its own gets its shared meaning (`COMMON_HELP`), so that --help
        describes it and shows its default."""
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.help is None:
            action.help = COMMON_HELP.get(action.dest)
        return action

    def __init__(self, *args, description: str | None = None, **kwargs):
        if description is not None:
            description = " ".join(description.split("\n\n")[0].split())
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, description=description, **kwargs)

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)
