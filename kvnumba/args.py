"""Argument checks shared by every public verb: ints, id lists and finite reals.

Each check returns the value in the form the caller keeps (a Python int, a fresh
int64 array, a float) or raises a typed error that names what was passed and what
is allowed. Nothing here knows a cache; the error class is the caller's choice
where the contract names one.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
from numba import njit

from .errors import ConfigError, ShapeError, UnknownSequenceError

_INT64_MAX = np.iinfo(np.int64).max


def describe(value) -> str:
    """`value` as an error message shows it: its repr and, where that hides it, its type."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = type(value).__name__
    return text if kind in ("int", "float", "str") else f"{text} ({kind})"


def is_int(value) -> bool:
    """True for Python and NumPy integers; False for bools (an id is never True or False)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_int(value, what: str, error=ShapeError) -> int:
    """`value` as a Python int, or `error` naming `what` and the value (bools are refused)."""
    if not is_int(value):
        raise error(f"{what}: expected an int, got {describe(value)}")
    return int(value)


def as_index(value, n: int, what: str, error=ShapeError) -> int:
    """An int in `[0, n)`, else `error` naming the value and the range."""
    index = as_int(value, what, error)
    if not 0 <= index < n:
        raise error(f"{what}: {index} is outside [0, {n})")
    return index


def as_finite(value, what: str, *, positive: bool = False) -> float:
    """A finite real (a Python or NumPy number, not a bool) as a float, else `ConfigError`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{what}: expected a finite real number, got {describe(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{what}={number}: must be finite")
    if positive and not number > 0:
        raise ConfigError(f"{what}={number}: must be > 0")
    return number


def as_ids(values, n: int, what: str) -> np.ndarray:
    """A fresh (never aliased) 1-D int64 array of ids in `[0, n)`.

    `values`: a NumPy integer array or a list/tuple of ints. Refused with
    `ShapeError`: bools, floats, strings, ragged or nested lists, 0-d or 2-D
    arrays. Out of range: `UnknownSequenceError` naming the id as passed (a uint64
    id is never reported as its wrapped int64 value).
    """
    if isinstance(values, np.ndarray):
        array = values
    else:
        if isinstance(values, (str, bytes, dict, set, frozenset)) or not hasattr(values, "__len__"):
            raise ShapeError(f"{what}: expected a 1-D list or array of ints, got "
                             f"{describe(values)}")
        if len(values) == 0:
            return np.empty(0, dtype=np.int64)
        kinds = set(map(type, values))   # a C-level pass: no Python loop per id
        wrong = [k for k in kinds if not issubclass(k, (int, np.integer))
                 or issubclass(k, (bool, np.bool_))]
        if wrong:
            raise ShapeError(f"{what}: ids are ints, got {wrong[0].__name__} in "
                             f"{describe(values)}")
        try:
            array = np.asarray(values)
        except OverflowError:
            array = np.asarray(values, dtype=object)
        if array.dtype == object and array.ndim == 1:
            # ints too large for int64: name the first as passed
            bad = next(int(v) for v in values if not -_INT64_MAX <= int(v) <= _INT64_MAX)
            raise UnknownSequenceError(f"{what}: sequence {bad} is not a column id in [0, {n})")
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ShapeError(f"{what}: expected a 1-D list or array of ints, got shape "
                         f"{array.shape} dtype {array.dtype}")
    ids = np.empty(array.size, np.int64)   # a copy: the caller may reuse its buffer at once
    bad = _copy_ids(array, n, ids)
    if bad >= 0:   # an unsigned array is named by its largest id: never a wrapped value
        bad = int(array.max()) if array.dtype.kind == "u" else int(array[bad])
        raise UnknownSequenceError(f"{what}: sequence {bad} is not a column id in [0, {n})")
    return ids


@njit(cache=True)
def _copy_ids(values, n, ids):
    """Copy `values` into `ids` in one compiled pass that stops at the first id outside
    `[0, n)`; returns its index (-1 when every id is in range)."""
    for i in range(values.size):
        value = values[i]
        if value < 0 or value >= n:
            return i
        ids[i] = value
    return -1
