"""Argument checks with one message formula: "Expected `name` to be <what it must be>, got <repr>".

Every public function and class checks its numeric arguments through these, so every refusal reads the
same way, names the argument, says what to pass and shows what was given (torchmetrics' and attrs'
manner). A ``bool`` is never a number here (``True`` is not an interval).

Example:
    >>> check_int(8, "capacity")
    8
    >>> check_int(0, "capacity")
    Traceback (most recent call last):
    ...
    ValueError: Expected `capacity` to be a positive integer, got 0
    >>> check_seconds(-1, "timeout")
    Traceback (most recent call last):
    ...
    ValueError: Expected `timeout` to be a number of seconds >= 0, got -1
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_int", "check_real", "check_seconds"]


def check_int(value: object, name: str, minimum: int = 1, note: str = "") -> int:
    """``value`` if it is an integer >= ``minimum`` (not a bool), else a ``ValueError``; ``note`` says
    what the number counts, in parentheses after the requirement.

    Example:
        >>> check_int(0, "start_step", minimum=0)
        0
        >>> check_int(1.5, "every", note="steps")
        Traceback (most recent call last):
        ...
        ValueError: Expected `every` to be a positive integer (steps), got 1.5
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"Expected `{name}` to be {what}{_note(note)}, got {value!r}")
    return int(value)


def check_real(
    value: object,
    name: str,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    finite: bool = False,
    unit: str = "a number",
    note: str = "",
) -> float:
    """``value`` as a float if it is a real number (not a bool, never NaN) within the bounds given:
    ``> above`` or ``>= at_least``, ``< below``, finite with ``finite``; else a ``ValueError``.

    Example:
        >>> check_real(0.02, "overhead", above=0, below=1, note="0.02 is 2 %")
        0.02
        >>> check_real(2, "overhead", above=0, below=1, note="0.02 is 2 %")
        Traceback (most recent call last):
        ...
        ValueError: Expected `overhead` to be a number in (0, 1) (0.02 is 2 %), got 2
        >>> check_real(float("nan"), "alpha", above=0)
        Traceback (most recent call last):
        ...
        ValueError: Expected `alpha` to be a number > 0, got nan
    """
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and not math.isnan(value)
    if ok:
        number = float(value)  # type: ignore[arg-type]
        ok = (
            (above is None or number > above)
            and (at_least is None or number >= at_least)
            and (below is None or number < below)
            and (not finite or math.isfinite(number))
        )
        if ok:
            return number
    if above is not None and below is not None:
        bounds = f" in ({_g(above)}, {_g(below)})"
    else:
        parts = [
            f"> {_g(above)}" if above is not None else "",
            f">= {_g(at_least)}" if at_least is not None else "",
        ]
        parts.append(f"< {_g(below)}" if below is not None else "")
        bounds = "".join(f" {part}" for part in parts if part)
    what = f"{'a finite ' + unit[2:] if finite and unit.startswith('a ') else unit}{bounds}"
    raise ValueError(f"Expected `{name}` to be {what}{_note(note)}, got {value!r}")


def check_seconds(value: object, name: str, *, zero: bool = True, forever: bool = True) -> float:
    """A duration: a real number of seconds, ``>= 0`` (``> 0`` without ``zero``), ``math.inf`` allowed
    with ``forever`` (say so where it means "wait forever"), NaN never.

    Example:
        >>> check_seconds(math.inf, "timeout"), check_seconds(0, "timeout")
        (inf, 0.0)
        >>> check_seconds(0, "close_timeout", zero=False, forever=True)
        Traceback (most recent call last):
        ...
        ValueError: Expected `close_timeout` to be a number of seconds > 0 (math.inf waits forever), got 0
    """
    note = "math.inf waits forever" if forever and not zero else ""
    if zero:
        return check_real(value, name, at_least=0, finite=not forever, unit="a number of seconds", note=note)
    return check_real(value, name, above=0, finite=not forever, unit="a number of seconds", note=note)


def _note(note: str) -> str:
    return f" ({note})" if note else ""


def _g(bound: float) -> str:
    return f"{bound:g}"
