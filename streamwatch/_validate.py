"""Argument checks with one message formula: "Expected `name` to be <what it must be>, got <repr>".

Every public function and class checks its numeric arguments through these, so every refusal reads the
same way, names the argument, says what to pass and shows what was given (torchmetrics' and attrs'
manner). A ``bool`` is never a number here (``True`` is not an interval), and NaN is in no range.

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


def check_int(
    value: object,
    name: str,
    minimum: int = 1,
    maximum: int | None = None,
    *,
    note: str = "",
    wrong_type: type[Exception] = ValueError,
) -> int:
    """``value`` if it is an integer in ``[minimum, maximum]`` (not a bool; numpy integers count), else a
    ``ValueError``. ``note`` says what the number counts, in parentheses after the requirement;
    ``wrong_type`` is what a value that is no integer at all raises (the operators raise ``TypeError``
    there; ``observe()`` has always raised ``ValueError``).

    Example:
        >>> check_int(0, "start_step", minimum=0)
        0
        >>> check_int(70000, "port", minimum=0, maximum=65535)
        Traceback (most recent call last):
        ...
        ValueError: Expected `port` to be an integer in [0, 65535], got 70000
        >>> check_int(1.5, "every", note="steps")
        Traceback (most recent call last):
        ...
        ValueError: Expected `every` to be a positive integer (steps), got 1.5
    """
    if type(value) is int and value >= minimum and (maximum is None or value <= maximum):
        return value  # (the common case, with no message to build)
    if maximum is not None:
        what = f"an integer in [{minimum}, {maximum}]"
    else:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    message = f"Expected `{name}` to be {what}{_note(note)}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise wrong_type(message)
    number = int(value)
    if number < minimum or (maximum is not None and number > maximum):
        raise ValueError(message)
    return number


def check_real(
    value: object,
    name: str,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    finite: bool = False,
    unit: str = "number",
    note: str = "",
    optional: bool = False,
    wrong_type: type[Exception] = ValueError,
) -> float:
    """``value`` as a float if it is a real number (not a bool, never NaN) within the bounds given:
    ``> above`` or ``>= at_least``, ``< below`` or ``<= at_most``, finite with ``finite``; else a
    ``ValueError`` (``wrong_type`` for a value that is no real number). ``optional``: the caller takes
    None too (the message says so; None itself is the caller's to handle).

    Example:
        >>> check_real(0.02, "overhead", above=0, below=1, note="0.02 is 2 %")
        0.02
        >>> check_real(2, "overhead", above=0, below=1, note="0.02 is 2 %")
        Traceback (most recent call last):
        ...
        ValueError: Expected `overhead` to be a number in (0, 1) (0.02 is 2 %), got 2
        >>> check_real(float("nan"), "alpha", above=0, at_most=1)
        Traceback (most recent call last):
        ...
        ValueError: Expected `alpha` to be a number in (0, 1], got nan
    """
    real = not isinstance(value, bool) and isinstance(value, numbers.Real)
    number = float(value) if real else math.nan  # type: ignore[arg-type]
    if (
        number == number
        and (above is None or number > above)
        and (at_least is None or number >= at_least)
        and (below is None or number < below)
        and (at_most is None or number <= at_most)
        and (not finite or math.isfinite(number))
    ):
        return number
    low = f"({_g(above)}" if above is not None else f"[{_g(at_least)}" if at_least is not None else None
    high = f"{_g(below)})" if below is not None else f"{_g(at_most)}]" if at_most is not None else None
    if low is not None and high is not None:
        bounds = f" in {low}, {high}"
    elif low is not None:
        bounds = f" {'>' if above is not None else '>='} {low[1:]}"
    elif high is not None:
        bounds = f" {'<' if below is not None else '<='} {high[:-1]}"
    else:
        bounds = ""
    what = f"{'None or ' if optional else ''}a {'finite ' if finite else ''}{unit}{bounds}"
    raise (ValueError if real else wrong_type)(f"Expected `{name}` to be {what}{_note(note)}, got {value!r}")


def check_seconds(
    value: object, name: str, *, zero: bool = True, forever: bool = True, optional: bool = False
) -> float:
    """A duration: a real number of seconds, ``>= 0`` (``> 0`` without ``zero``), ``math.inf`` allowed
    with ``forever``, NaN never.

    Example:
        >>> check_seconds(math.inf, "timeout"), check_seconds(0, "timeout")
        (inf, 0.0)
        >>> check_seconds(0, "close_timeout", zero=False)
        Traceback (most recent call last):
        ...
        ValueError: Expected `close_timeout` to be a number of seconds > 0 (math.inf waits forever), got 0
        >>> check_seconds(math.inf, "timeout", zero=False, forever=False)
        Traceback (most recent call last):
        ...
        ValueError: Expected `timeout` to be a finite number of seconds > 0, got inf
    """
    note = "math.inf waits forever" if forever and not zero else ""
    unit, finite = "number of seconds", not forever
    if zero:
        return check_real(value, name, at_least=0, finite=finite, unit=unit, note=note, optional=optional)
    return check_real(value, name, above=0, finite=finite, unit=unit, note=note, optional=optional)


def _note(note: str) -> str:
    return f" ({note})" if note else ""


def _g(bound: float | None) -> str:
    return f"{bound:g}"
