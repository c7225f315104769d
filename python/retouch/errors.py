"""Errors that reach a user: the message is one line that says what to fix."""


class RetouchError(Exception):
    """Bad input or an unusable environment; the CLI prints it as one line and exits with 2."""


class ModelError(RetouchError):
    """An unknown built-in name, or a folder that is not a loadable diffusers pipeline."""


class InputError(RetouchError):
    """An unreadable or inconsistent image, mask or prompt."""
