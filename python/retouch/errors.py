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


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line naming the flag (exit 2), not the whole usage block above it;
    a `description` given as a module docstring is cut to its first paragraph (its first line would end
    mid-sentence)."""

    def __init__(self, *args, description: str | None = None, **kwargs):
        if description is not None:
            description = " ".join(description.split("\n\n")[0].split())
        super().__init__(*args, description=description, **kwargs)

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)
