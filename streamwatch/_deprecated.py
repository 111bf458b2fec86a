"""Names that left a public namespace (internals): still importable through the module's ``__getattr__``,
with a ``DeprecationWarning`` saying where they live now (removed in a later release).

Example:
    >>> import warnings
    >>> moved = {"Chain": ("streamwatch._pipeline", "what composing operators with | gives")}
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     found = moved_name("streamwatch", moved, "Chain")
    >>> found.__name__, caught[0].category.__name__
    ('Chain', 'DeprecationWarning')
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping

__all__ = ["moved_name"]


def moved_name(package: str, moved: Mapping[str, tuple[str, str]], name: str) -> object:
    """``package.name`` from where it moved (``moved[name]``: its module and what it is), warned about;
    AttributeError for any other name (what a module's ``__getattr__`` must raise)."""
    found = moved.get(name)
    if found is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module, why = found
    warnings.warn(
        f"{package}.{name} is internal ({why}) and leaves the public API; it is {module}.{name} for now "
        "and will be removed",
        DeprecationWarning,
        stacklevel=3,  # the user's attribute access (through the module's __getattr__)
    )
    return getattr(importlib.import_module(module), name)
