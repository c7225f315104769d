"""Template ids and the names of guidance variants, checked once where they enter the cache.

A template id names files of the disk tier, so it is a plain token: letters, digits, '_' and '-'
(no '.', no '/': no path can be built from it). The unconditional rows of a classifier-free-guidance
batch are recorded with the template: Flux/SD3 contexts address them as the row template id
`<id>/uncond`, UNet contexts as names prefixed `uncond.`; the store files both under `<id>` with
the prefixed names, so a template and its guidance rows are kept, evicted and dropped together.
"""

from __future__ import annotations

import re

from retouch.errors import InputError

TEMPLATE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
UNCOND_SUFFIX = "/uncond"  # row template id of a Flux/SD3 guidance batch's unconditional rows
UNCOND_PREFIX = "uncond."  # name prefix of the unconditional rows' activations


def check_template_id(template_id: str) -> str:
    """`template_id` if it is a valid id, else InputError saying what a valid one looks like."""
    if not isinstance(template_id, str) or not TEMPLATE_ID_PATTERN.fullmatch(template_id):
        raise InputError(f"template id {template_id!r} is invalid: use 1-128 letters, digits, '_' or '-', "
                         "starting with a letter or digit")
    return template_id


def uncond_row_id(template_id: str) -> str:
    """The row template id under which a Flux/SD3 guidance batch records its unconditional rows."""
    return template_id + UNCOND_SUFFIX


def stored_key(template_id: str, name: str) -> tuple[str, str]:
    """(template, name) under which the store keeps activation `name` of row template `template_id`."""
    if template_id.endswith(UNCOND_SUFFIX):
        return check_template_id(template_id[: -len(UNCOND_SUFFIX)]), UNCOND_PREFIX + name
    return check_template_id(template_id), name


def base_name(name: str) -> str:
    """The activation's name without a guidance-variant prefix ("uncond.out" -> "out")."""
    return name.removeprefix(UNCOND_PREFIX)
