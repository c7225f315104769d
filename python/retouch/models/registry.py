"""The built-in models by name."""

from ..errors import ModelError
from .bench import BENCH_SPECS
from .spec import ModelSpec
from .tiny import TINY_SPECS

_SPECS_BY_NAME = {spec.name: spec for spec in TINY_SPECS + BENCH_SPECS}
assert len(_SPECS_BY_NAME) == len(TINY_SPECS) + len(BENCH_SPECS), "built-in model names must be unique"


def list_models() -> list[ModelSpec]:
    """Every built-in model: the tiny ones first, then the bench ones."""
    return list(_SPECS_BY_NAME.values())


def is_builtin(name: str) -> bool:
    return name in _SPECS_BY_NAME


def get_spec(name: str) -> ModelSpec:
    """The built-in model called `name`; ModelError naming the valid ones if there is none."""
    spec = _SPECS_BY_NAME.get(name)
    if spec is None:
        raise ModelError(f"unknown model {name!r}; built-in models: {', '.join(_SPECS_BY_NAME)}")
    return spec
