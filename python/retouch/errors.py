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


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line naming the flag (exit 2), not the whole usage block above it;
    a `description` given as a module docstring is cut to its first paragraph (its first line would end
    mid-sentence); every option's default shows in --help (`DefaultsShown`)."""

    def __init__(self, *args, description: str | None = None, **kwargs):
        if description is not None:
            description = " ".join(description.split("\n\n")[0].split())
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, description=description, **kwargs)

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)
