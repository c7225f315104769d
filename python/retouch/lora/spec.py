"""What a request asks for: which LoRA adapters, at which scales (`lora` on the HTTP API, the CLI and
`Engine.submit`). Parsed and checked here, at every boundary, with errors that name the field."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from retouch.errors import InputError

MAX_PER_REQUEST = 4  # adapters one request may stack (each is one more kernel pass over its rows)
MAX_SCALE = 16.0
# A file name in --lora-dir without its suffix: no separators, no leading dot (no path escapes the folder).
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# SCALE of "NAME:SCALE": a plain decimal ("1", "0.8", "-.5", "+2."). float() alone also takes "1_0" (as 10),
# "inf", "nan", non-ASCII digits and exponents; a scale lies in [-16, 16], where an exponent only hides a
# typo ("1e1" for "1.1"), so none of them is a scale. JSON numbers ({"scale": 1e-1}) are JSON's, not this.
SCALE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")


class LoraError(InputError):
    """A LoRA that cannot be used: unknown, unreadable, or not for this model. `field` is "lora"."""

    field = "lora"


@dataclass(frozen=True, slots=True, weakref_slot=True)
class LoraUse:
    """One adapter of a request: its name in --lora-dir and its scale (diffusers' `set_adapters` weight).
    Weakly referable: the LoRA manager keeps an adapter on the device while a queued request's use is alive."""

    name: str
    scale: float = 1.0

    def __post_init__(self):
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise LoraError(f"lora name {self.name!r} must be 1-128 letters, digits, '.', '_' or '-' "
                            "(a file of --lora-dir without its suffix)")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale) \
                or abs(self.scale) > MAX_SCALE:
            raise LoraError(f"lora scale of {self.name!r} must be a number in [-{MAX_SCALE:g}, {MAX_SCALE:g}], "
                            f"got {self.scale!r}")

    def header(self) -> dict:
        return {"name": self.name, "scale": float(self.scale)}


LoraChoice = tuple[LoraUse, ...]  # a request's adapters, in the order given; () for none


def parse_lora(value) -> LoraChoice:
    """A request's `lora` as any boundary receives it: None or "" (none); "name" or "name:scale", comma
    separated ("a:0.8,b"); a list of such strings; a list of {"name": ..., "scale": ...} objects (JSON);
    or LoraUse values. Names may not repeat."""
    if value is None or value == "" or value == []:
        return ()
    if isinstance(value, LoraUse):
        value = [value]
    if isinstance(value, str):
        value = [part for part in value.split(",")]
    if not isinstance(value, (list, tuple)):
        raise LoraError(f"lora must be a name, 'name:scale', or a list of them or of {{name, scale}} objects, "
                        f"got {type(value).__name__}")
    uses = tuple(_one(item) for item in value)
    if len(uses) > MAX_PER_REQUEST:
        raise LoraError(f"at most {MAX_PER_REQUEST} LoRAs per request, got {len(uses)}")
    names = [use.name for use in uses]
    if len(set(names)) != len(names):
        raise LoraError(f"lora names repeat: {names}")
    return uses


def _one(item) -> LoraUse:
    if isinstance(item, LoraUse):
        return item
    if isinstance(item, str):
        name, colon, scale = item.partition(":")
        name = name.strip()  # " grain : 0.5 " is grain at 0.5
        if not colon:
            return LoraUse(name)
        if not SCALE.fullmatch(scale.strip()):
            raise LoraError(f"lora scale of {name!r} must be a number written as plain decimals (1, 0.8, -0.5), "
                            f"got {scale!r}")
        return LoraUse(name, float(scale))
    if isinstance(item, dict):
        unknown = set(item) - {"name", "scale"}
        if unknown or "name" not in item:
            raise LoraError(f"a lora object has a name and an optional scale, got keys {sorted(item)}")
        return LoraUse(item["name"], item.get("scale", 1.0))
    raise LoraError(f"a lora entry must be a string or a {{name, scale}} object, got {type(item).__name__}")


def choice_header(choice: LoraChoice) -> list[dict]:
    """The JSON form that crosses process boundaries (`parse_lora` reads it back)."""
    return [use.header() for use in choice]
