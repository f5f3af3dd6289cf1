"""How the serving face words a refusal: an argument that must be an int (`as_int`), and
a cache's typed error retold with the session it concerns in front (`naming`)."""
from __future__ import annotations

from ..args import describe, is_int
from ..errors import KVCacheError, SessionError


def as_int(value, what: str) -> int:
    """`value` as an int, or `SessionError` naming `what`."""
    if not is_int(value):
        raise SessionError(f"{what}: expected an int, got {describe(value)}")
    return int(value)


def naming(exc: KVCacheError, context: str) -> KVCacheError:
    """The same error type with `context` (naming the session) in front of its message."""
    try:
        return type(exc)(f"{context}: {exc}")
    except Exception:  # an error class with another constructor: keep it as it is
        return exc
