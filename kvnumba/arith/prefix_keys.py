"""The prefix index's keys (contract §14): chained digests of whole pages of token ids.

Pure functions over token ids and bytes: nothing here knows a cache. Page `i` of a
token list (its tokens `[i P, (i + 1) P)`) has the key

    key_i = BLAKE2b-256(key_{i-1} || len(extra) || extra || tokens of page i as int64 LE)

with `key_{-1}` the fixed root `ROOT`, so a key names its page's tokens, every token
before them and the caller's extra key (a tenant salt, an adapter name, an image digest:
whatever changes K and V besides the token ids). Two token lists share the key of page
`i` exactly when they agree on every token up to the end of that page and carry the
same extra key (up to a BLAKE2b collision). Only whole pages have keys.
"""
from __future__ import annotations

import hashlib

import numpy as np

from ..args import as_count, describe, is_listlike
from ..errors import ShapeError

#: the parent of a list's first page
ROOT = bytes(32)
#: bytes of a key
KEY_BYTES = 32


def extra_bytes(extra_key) -> bytes:
    """The extra key as bytes: None (none), `bytes`/`bytearray`, or a `str` (UTF-8);
    anything else is `ShapeError`."""
    if extra_key is None:
        return b""
    if isinstance(extra_key, (bytes, bytearray)):
        return bytes(extra_key)
    if isinstance(extra_key, str):
        return extra_key.encode()
    raise ShapeError(f"extra_key={describe(extra_key)}: pass None, bytes or a str (a tenant, "
                     f"an adapter name, an image digest)")


def token_ids(tokens, what: str) -> np.ndarray:
    """`tokens` (a list or 1-D integer array of non-negative token ids) as int64 `[n]`, or
    `ShapeError` naming `what`."""
    try:
        ids = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"{what}: expected a 1-D list of token ids, got "
                         f"{describe(tokens)}") from exc
    if ids.size == 0:
        return np.zeros(0, np.int64)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ShapeError(f"{what}: expected a 1-D list of integer token ids, got shape "
                         f"{ids.shape} dtype {ids.dtype}")
    if ids.dtype.kind == "i" and ids.min() < 0:
        raise ShapeError(f"{what}: token ids are >= 0, got {int(ids.min())}")
    return ids.astype(np.int64)


def page_keys(tokens, page_size: int, extra=b"", parent: bytes = ROOT,
              first: int = 0) -> list:
    """The keys of the whole pages of `tokens` (token ids from position 0: a list or a
    1-D integer array) from page `first` on, `parent` being the key of page `first - 1`
    (`ROOT` for page 0), under the extra key `extra` (None, bytes or str): one 32-byte
    key per page, `len(tokens) // page_size - first` of them. `page_size` (an int >= 1:
    the cache's `config.page_size`) and `first` (an int >= 0) are `ConfigError` otherwise,
    a `parent` that is not a key `ShapeError`."""
    tokens = token_ids(tokens, "page_keys tokens")
    extra = extra_bytes(extra)
    page_size = as_count(page_size, "page_keys page_size (the cache's config.page_size)", 1)
    first = as_count(first, "page_keys first", 0)
    if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
        raise ShapeError(f"page_keys parent: expected a {KEY_BYTES}-byte page key (ROOT or a "
                         f"key page_keys made), got {describe(parent)}")
    n_pages = tokens.size // page_size
    if n_pages <= first:
        return []
    pages = np.ascontiguousarray(tokens[:n_pages * page_size], dtype="<i8")
    pages = pages.reshape(n_pages, page_size)
    salt = len(extra).to_bytes(8, "little") + extra
    keys = []
    for i in range(first, n_pages):
        digest = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        digest.update(salt)
        digest.update(pages[i].tobytes())
        parent = digest.digest()
        keys.append(parent)
    return keys


def as_keys(keys, what: str) -> list:
    """`keys` (a list of page keys, as `page_keys` makes them) as a list of bytes, or
    `ShapeError` naming `what`."""
    if not is_listlike(keys):
        raise ShapeError(f"{what}: expected a list of page keys (prefix_keys.page_keys), got "
                         f"{describe(keys)}")
    keys = list(keys)
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ShapeError(f"{what}: key {i} is {describe(key)}; page keys are "
                             f"{KEY_BYTES}-byte digests (prefix_keys.page_keys)")
    return keys


class KeyChain:
    """The page keys of one growing token list (a session's), kept between calls so that
    each new page is hashed once: `keys(tokens)` rehashes only from the first page where
    `tokens` differ from what was hashed before (a rewind and new tokens), and past it;
    `fresh` is that page (the first whose key the last call made)."""

    def __init__(self, page_size: int, extra: bytes = b""):
        self.page_size, self.extra = page_size, extra
        self.tokens = np.zeros(0, np.int64)
        self.list: list = []
        self.fresh = 0

    def keys(self, tokens: np.ndarray) -> list:
        """The keys of `tokens`' whole pages (int64 `[n]`, from position 0)."""
        size = self.page_size
        n_pages = tokens.size // size
        same = min(len(self.list), n_pages)
        if same:
            differs = np.flatnonzero(self.tokens[:same * size] != tokens[:same * size])
            if differs.size:
                same = int(differs[0]) // size
        del self.list[same:]
        self.fresh = same
        parent = self.list[-1] if same else ROOT
        self.list += page_keys(tokens[:n_pages * size], size, self.extra, parent, same)
        self.tokens = tokens[:n_pages * size].copy()
        return self.list

    def copy(self) -> "KeyChain":
        chain = KeyChain(self.page_size, self.extra)
        chain.tokens, chain.list, chain.fresh = self.tokens, list(self.list), self.fresh
        return chain
