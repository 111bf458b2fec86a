"""The public namespace is exactly `__all__` (ruff's RUF022 keeps it sorted) and all of it is documented."""

from __future__ import annotations

import inspect

import pytest

import streamwatch
from streamwatch import detectors, metrics, ops, sinks

SUBMODULES = {"cli", "detectors", "integrations", "metrics", "ops", "sinks", "testing"}


@pytest.mark.parametrize("module", [streamwatch, detectors, metrics, ops, sinks], ids=lambda m: m.__name__)
def test_all_lists_exactly_the_public_names(module) -> None:
    exported = module.__all__
    public = {name for name in vars(module) if not name.startswith("_")} - {"annotations"}
    assert len(exported) == len(set(exported))
    assert public - SUBMODULES == set(exported) - SUBMODULES


@pytest.mark.parametrize("module", [streamwatch, detectors, metrics, ops, sinks], ids=lambda m: m.__name__)
def test_every_public_callable_has_a_docstring(module) -> None:
    undocumented = [
        name
        for name in module.__all__
        if (inspect.isclass(getattr(module, name)) or inspect.isfunction(getattr(module, name)))
        and not (getattr(module, name).__doc__ or "").strip()
    ]
    assert undocumented == []


@pytest.mark.parametrize(
    ("module", "name"),
    [
        (streamwatch, "Chain"),
        (streamwatch, "Node"),
        (streamwatch, "Source"),
        (streamwatch, "Stream"),
        (metrics, "Binding"),
        (metrics, "DERIVED"),
    ],
)
def test_internals_that_left_the_namespace_still_import_with_a_deprecation_warning(module, name) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{module.__name__}\.{name} is internal"):
        value = getattr(module, name)
    assert value is not None
    assert name not in module.__all__


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Nonexistent'"):
        streamwatch.Nonexistent  # noqa: B018
