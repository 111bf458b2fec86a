"""The operators' shared argument checks (build the message, then raise) and how a user function
appears in an operator's repr.

Example:
    >>> positive_int("size", 8), describe(lambda x: x)
    (8, '<lambda>')
"""

from __future__ import annotations

import numbers

from streamwatch._validate import check_int, check_real

__all__ = ["as_float", "as_int", "check_callable", "describe", "positive_int", "positive_number"]


def as_int(value: object, message: str) -> int:
    """``value`` as an ``int``, or ``TypeError(message)``; ``bool`` is not an integer here."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(message)
    return int(value)


def as_float(value: object, message: str) -> float:
    """``value`` as a ``float`` (ints accepted), or ``TypeError(message)``; ``bool`` is refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(message)
    return float(value)


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an integer >= 1: a ``TypeError`` if it is no integer, else a ``ValueError``."""
    return check_int(value, name, wrong_type=TypeError)


def positive_number(name: str, value: object) -> float:
    """``value`` if it is a finite real number > 0: a ``TypeError`` if it is no number, else a
    ``ValueError``."""
    return check_real(value, name, above=0, finite=True, wrong_type=TypeError)


def check_callable(name: str, value: object) -> None:
    if not callable(value):
        raise TypeError(f"Expected `{name}` to be callable, got {value!r}")


def describe(fn: object) -> str:
    """How a user function appears in reprs: its qualified name (``<lambda>``, ``abs``) or its repr.

    The ``outer.<locals>.`` part of a function defined inside another is left out.
    """
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name.rpartition(".<locals>.")[2] if isinstance(name, str) else repr(fn)
