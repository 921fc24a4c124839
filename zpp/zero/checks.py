"""Typed value checks shared by the typed config (:mod:`zpp.zero.config`) and the DeepSpeed
edge (:mod:`zpp.zero.deepspeed_config`).

Every check takes ``where`` (who is checking: ``"ZeroConfig"``, ``"DeepSpeed config"``),
``name`` (the field or dotted key) and the value, returns the value (an integral float such
as ``5e8`` becomes ``5e8``'s int where ``lenient`` allows it) and otherwise raises a
``ValueError`` naming both, ``"{where}: {name}={value!r} must be ..."``.

[Note: strict types]
Booleans are booleans: the string ``"false"`` is refused, not read as true, and ``True`` is
not a number (``gradient_clipping: true`` is refused, not 1.0). Only at the DeepSpeed edge
(``lenient=True``), where DeepSpeed reads them so, integers may be written as integral
floats in JSON (``"reduce_bucket_size": 5e8``) and a boolean as ``0`` or ``1``; the typed
dataclasses take ints and bools. ``"auto"`` is a
placeholder the Hugging Face Trainer / Accelerate integrations fill in before DeepSpeed sees
the config; zpp refuses it with a message saying so.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "check_bool", "check_choice", "check_int", "check_mapping", "check_number", "check_pair", "check_str",
    "check_str_tuple", "fail", "from_section",
]


def _hint(value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return (" ('auto' is a placeholder the Hugging Face Trainer/Accelerate integration fills in; "
                "DeepSpeed and zpp need the value itself)")
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "0", "1", "yes", "no", "on", "off"):
        return f" (the string {value!r} is not a boolean or a number: write the JSON value without quotes)"
    return ""


def fail(where: str, name: str, value: Any, what: str) -> ValueError:
    """The error every check raises: ``{where}: {name}={value!r} must be {what}``."""
    return ValueError(f"{where}: {name}={value!r} must be {what}{_hint(value)}")


def check_bool(where: str, name: str, value: Any, *, lenient: bool = False) -> bool:
    """A bool; with ``lenient`` the integers 0 and 1 are taken too (as false and true)."""
    if lenient and type(value) is int and value in (0, 1):
        return bool(value)
    if not isinstance(value, bool):
        raise fail(where, name, value, "true or false")
    return value


def check_int(where: str, name: str, value: Any, *, lo: int | None = None, hi: int | None = None,
              lenient: bool = False) -> int:
    """An int in ``[lo, hi]``; with ``lenient`` an integral float (``1e4``) is taken too."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok and lenient and isinstance(value, float) and math.isfinite(value) and value == int(value):
        value, ok = int(value), True
    if not ok:
        raise fail(where, name, value, "an integer" + _range(lo, hi))
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise fail(where, name, value, "an integer" + _range(lo, hi))
    return value


def check_int_or_auto(where: str, name: str, value: Any, *, lenient: bool = False) -> int | str:
    """An int >= 0 (with ``lenient`` an integral float too), or "auto": zpp chooses."""
    if value == "auto":
        return value
    try:
        return check_int(where, name, value, lo=0, lenient=lenient)
    except ValueError:
        raise fail(where, name, value, 'an integer >= 0 or "auto"') from None


def check_number(where: str, name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False, hi_open: bool = False) -> float | int:
    """A finite int or float (not a bool) within the bounds (closed unless ``*_open``)."""
    what = "a finite number" + _range(lo, hi, lo_open, hi_open)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise fail(where, name, value, what)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise fail(where, name, value, what)
    if hi is not None and (value >= hi if hi_open else value > hi):
        raise fail(where, name, value, what)
    return value


def check_choice(where: str, name: str, value: Any, choices: Iterable[Any]) -> Any:
    choices = tuple(choices)
    if isinstance(value, bool) or value not in choices:
        raise fail(where, name, value, f"one of {list(choices)}")
    return value


def check_str(where: str, name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise fail(where, name, value, "a non-empty string")
    return value


def check_pair(where: str, name: str, value: Any, *, lo: float = 0.0, hi: float = 1.0) -> tuple[float, float]:
    """Two numbers in ``[lo, hi)`` (Adam's ``betas``), given as a list or tuple."""
    what = f"two numbers in [{lo}, {hi})"
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise fail(where, name, value, what)
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v < hi):
            raise fail(where, name, value, what)
    return (value[0], value[1])


def check_str_tuple(where: str, name: str, value: Any) -> tuple[str, ...]:
    """A list or tuple of non-empty strings, returned as a tuple."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or \
            not all(isinstance(v, str) and v for v in value):
        raise fail(where, name, value, "a list of non-empty strings")
    return tuple(value)


def check_mapping(where: str, name: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise fail(where, name, value, "a JSON object (dict)")
    return value


def from_section(cls: type, where: str, section: str, d: Mapping[str, Any]) -> Any:
    """``cls(**d)`` for the config section ``section`` (a validated dataclass): unknown keys
    raise ``ValueError`` listing them with the section's keys, and the class's own errors are
    raised again naming the key as the user wrote it (``where: section.key``)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown keys in {section!r}: {unknown}; its keys are {sorted(fields)}")
    try:
        return cls(**d)
    except ValueError as e:
        raise ValueError(str(e).replace(f"{cls.__name__}: ", f"{where}: {section}.", 1)) from None


def _range(lo, hi, lo_open=False, hi_open=False) -> str:
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f" {'>' if lo_open else '>='} {lo}"
    if lo is None:
        return f" {'<' if hi_open else '<='} {hi}"
    return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
