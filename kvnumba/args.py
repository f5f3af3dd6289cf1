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

from .errors import ConfigError, SessionError, ShapeError, UnknownSequenceError

_INT64_MAX = np.iinfo(np.int64).max
#: the magnitudes a nonzero scale or softcap may have (`as_finite`)
KERNEL_REAL_MIN, KERNEL_REAL_MAX = 2.0 ** -60, 2.0 ** 60


class SessionId(int):
    """A session id handed out by a `SessionTable`: an int, never a sequence id.

    The table accepts it wherever it takes a session (as it does plain ints); every
    BatchControl verb that takes a sequence id refuses it with `SessionError`
    naming the sequence to pass instead, `table.seq(sid)`.
    """

    _seq = None   # the sequence holding the session while it is open (the table sets it)

    def refusal(self, what: str) -> SessionError:
        """The `SessionError` of a verb (`what`) that was given this session id for a
        sequence id."""
        sid = int(self)
        if self._seq is None:
            return SessionError(f"{what}: {sid} is the id of a closed session, not a sequence "
                                f"id; pass a sequence id (table.seq(sid) of an open session)")
        return SessionError(f"{what}: {sid} is a session id; pass its sequence id "
                            f"table.seq({sid}) = {self._seq}")


def describe(value) -> str:
    """`value` as an error message shows it: its repr and, where that hides it, its type."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = type(value).__name__
    return text if kind in ("int", "float", "str") else f"{text} ({kind})"


def is_listlike(value) -> bool:
    """True for a list, a tuple, an array of at least one dimension or another iterable;
    False for str and bytes, 0-d arrays, numbers and None."""
    return not isinstance(value, (str, bytes)) and hasattr(value, "__iter__") and \
        getattr(value, "ndim", 1) != 0


def is_int(value) -> bool:
    """True for Python and NumPy integers; False for bools (an id is never True or False)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_int(value, what: str, error=ShapeError) -> int:
    """`value` as a Python int, or `error` naming `what` and the value (bools are refused)."""
    if not is_int(value):
        raise error(f"{what}: expected an int, got {describe(value)}")
    return int(value)


def as_count(value, what: str, least: int, error=ConfigError) -> int:
    """`value` as a Python int of at least `least`, or `error` naming `what`."""
    value = as_int(value, what, error)
    if value < least:
        raise error(f"{what}={value}: must be at least {least}")
    return value


def as_id(value, n: int, what: str) -> int:
    """A sequence id in `[0, n)` as a Python int. Refused: a `SessionId` (`SessionError`
    naming its sequence), a non-int (`ShapeError`), an id out of range
    (`UnknownSequenceError`)."""
    if type(value) is not int:
        if isinstance(value, SessionId):
            raise value.refusal(what)
        value = as_int(value, f"{what}: sequence id")
    if not 0 <= value < n:
        raise UnknownSequenceError(f"{what}: sequence {value} is not a sequence id in [0, {n})")
    return value


def as_finite(value, what: str, *, positive: bool = False) -> float:
    """A real the kernels take as a float32 (`scale`, `softcap`), as a float, else
    `ConfigError` naming the value and the rule.

    Accepted: a Python or NumPy real (not a bool) that is 0 or has magnitude in
    `[KERNEL_REAL_MIN, KERNEL_REAL_MAX]` = `[2**-60, 2**60]`; `positive`: also > 0. The
    kernels fold scale and softcap into each other's products and quotients and into
    `log2(e)`, and in that range none of those leaves float32's normal range, so no
    accepted value turns into inf, NaN or 0 (float32 rounds it to 24 bits, no more).
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{what}: expected a finite real number, got {describe(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{what}={number}: must be finite")
    if positive and not number > 0:
        raise ConfigError(f"{what}={number}: must be > 0")
    magnitude = abs(number)
    if magnitude > KERNEL_REAL_MAX or 0 < magnitude < KERNEL_REAL_MIN:
        raise ConfigError(f"{what}={number!r}: the kernels compute in float32, so a nonzero "
                          f"value must have magnitude in [2**-60, 2**60] = "
                          f"[{KERNEL_REAL_MIN!r}, {KERNEL_REAL_MAX!r}]")
    return number


def as_ids(values, n: int, what: str) -> np.ndarray:
    """A fresh (never aliased) 1-D int64 array of ids in `[0, n)`.

    `values`: a NumPy integer array or a list/tuple of ints. Refused with
    `ShapeError`: bools, floats, strings, ragged or nested lists, 0-d or 2-D
    arrays. A `SessionId` among them (in a list, a tuple or an object array; an
    integer array cannot hold one): `SessionError` naming its sequence. Out of
    range: `UnknownSequenceError` naming the id as passed (a uint64 id is never
    reported as its wrapped int64 value).
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
        if SessionId in kinds:
            _refuse_session_ids(values, what)
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
            raise UnknownSequenceError(f"{what}: sequence {bad} is not a sequence id in [0, {n})")
    if array.ndim != 1 or array.dtype.kind not in "iu":
        if array.dtype.kind == "O":   # a session id in an object array is named first
            _refuse_session_ids(array.flat, what)
        raise ShapeError(f"{what}: expected a 1-D list or array of ints, got shape "
                         f"{array.shape} dtype {array.dtype}")
    ids = np.empty(array.size, np.int64)   # a copy: the caller may reuse its buffer at once
    bad = _copy_ids(array, n, ids)
    if bad >= 0:   # an unsigned array is named by its largest id: never a wrapped value
        bad = int(array.max()) if array.dtype.kind == "u" else int(array[bad])
        raise UnknownSequenceError(f"{what}: sequence {bad} is not a sequence id in [0, {n})")
    return ids


def _refuse_session_ids(values, what: str) -> None:
    """Raise the refusal of the first `SessionId` among `values`, if there is one."""
    for value in values:
        if isinstance(value, SessionId):
            raise value.refusal(what)


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
