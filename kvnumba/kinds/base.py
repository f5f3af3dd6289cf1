"""The protocol every layer kind answers (`LayerKind`), and a layer's K/V shape
(`LayerShape`).

A kind's page work runs on a *page group*: the layers that share page ids (contract §4:
every layer paged by position, or the ring layers of one ring size), whose host pages a
`host.page_accounting.GroupPages` keeps (`table`, `held`, `refs`, the free stack,
`owner`). The kind decides what its group's pages do; the group object does the
bookkeeping. Every method here is pure or works on the group it is given: no kind
touches a device.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np


class LayerShape(NamedTuple):
    """A layer's K/V shape: `n_kv_heads` heads of `head_dim` K elements and `v_head_dim`
    V elements each; `v_in_k`: V is the first `v_head_dim` values of each stored K row (a
    latent layer), stored nothing of its own."""

    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    v_in_k: bool = False


class LayerKind(Protocol):
    """What every layer kind answers, one line each.

    Naming and masks:
      `name`: the kind's one word ("flat", "latent", "ring", "chunked", "shared").
      `stores`: whether the layer holds K/V of its own; `v_in_k`: whether its V is read
      from its K rows (a latent layer); `window`: its sliding window W, or None.
      `source(layer)`: the layer whose K/V it reads (itself, or a shared layer's
      producer).
      `keeps_state`: whether it keeps a state per sequence instead of K/V (`state`).
      `describe()`: how refusals name the layer ("window 4096", "shared with layer 3").
      `mask_code`: the kernels' key mask (0 every key, W a sliding window, -C chunks).
      `validate(layer, config)`: refuse (`ConfigError`) a config the kind cannot serve.
    Bytes and storage:
      `position_bytes(shape, itemsize)`: bytes one position of one sequence takes.
      `planes(shape)`: the storage planes a page of the layer allocates, `(role,
      width)` each ("kv", or "k" and "v"; a latent layer one "k").
    Pages (on the layer's page group; `rows` 0: one row per position, else a ring):
      `rows(max_write, capacity)`: rows a sequence's page table covers (0: capacity).
      `claim_pages(table_pages)`: pages a sequence takes when claimed.
      `sequence_pages(positions, table_pages, page_size)`: pages a sequence of
      `positions` positions holds.
      `clone_pages(keep, page_size, table_pages)`: fresh pages a clone takes.
      `clone(group, src, dst, keep)`: a clone's pages; `(row runs, shared entries)`.
      `pages_by_step`: whether its pages follow positions; such a kind also answers
      `step_pages(group, seqs, totals, pos)`: new pages a step takes;
      `claim_step(group, seqs, totals, pos, needed)`: take them, `(patches, row runs)`;
      `rewind(group, seq, position)` / `abort(group, seqs, pos)`: pages let go.
    Floors:
      `floor(high_water, rows, max_write)`: the lowest position a sequence resumes at.
      `floor_key(rows)`: layers of equal keys have equal floors (None: always 0).
      `resumed_high_water(position, max_write)`: a prefix hit's high-water at
      `position`.
      `resume_needs()`: the positions resuming at p reads, as a floor's refusal says
      (kinds whose `floor_key` is not None).
    Prefix index (contract §14):
      `history(rows, max_write, capacity)`: positions before a resume point it reads.
      `kept_rows(page_size, history)`: rows of a page a node keeps on pages of its own.
      `first_registrable(high_water, rows, kept, page_size)`: the first page of
      positions a sequence can still register.
      `indexed_elsewhere(group, seq, depth)`: whether the index already holds the page.
      `node_page(group, seq, depth, own)`: the page a new node owns of the group.
      `kept_runs(group, seq, depth, own, kept)`: row runs copying a registered page's
      kept rows onto the node's own page `own` (None: it owns none of its own).
      `restore(group, seq, pages, end, history, kept, page_size)`: a hit's pages held,
      or the rows to copy back.

    A kind that stores nothing (`shared`) answers the naming, bytes and storage
    questions only: it is in no page group, and its mask, rows and floor are those of
    the layer it reads. A kind that keeps a state (`state`) is in no page group either:
    it answers the naming, bytes and floor questions, and `sequence_bytes(itemsize,
    state_itemsize, max_write, capacity)`, the bytes one sequence holds whatever its
    length.
    """

    name: str
    stores: bool
    keeps_state: bool
    v_in_k: bool
    window: int | None

    def source(self, layer: int) -> int: ...

    def describe(self) -> str: ...

    @property
    def mask_code(self) -> int: ...

    def validate(self, layer: int, config) -> None: ...

    def position_bytes(self, shape: LayerShape, itemsize: int) -> int: ...

    def planes(self, shape: LayerShape) -> tuple: ...

    def rows(self, max_write: int, capacity: int) -> int: ...

    def claim_pages(self, table_pages: int) -> int: ...

    def sequence_pages(self, positions: int, table_pages: int, page_size: int) -> int: ...

    pages_by_step: bool

    def step_pages(self, group, seqs: np.ndarray, totals: np.ndarray,
                   pos: np.ndarray) -> int: ...

    def claim_step(self, group, seqs, totals, pos, needed: int) -> tuple: ...

    def clone_pages(self, keep: int, page_size: int, table_pages: int) -> int: ...

    def clone(self, group, src: int, dst: int, keep: int) -> tuple: ...

    def rewind(self, group, seq: int, position: int) -> None: ...

    def abort(self, group, seqs: np.ndarray, pos: np.ndarray) -> None: ...

    def floor(self, high_water, rows: int, max_write: int): ...

    def floor_key(self, rows: int): ...

    def resumed_high_water(self, position: int, max_write: int) -> int: ...

    def history(self, rows: int, max_write: int, capacity: int) -> int: ...

    def kept_rows(self, page_size: int, history: int) -> int: ...

    def first_registrable(self, high_water: int, rows: int, kept: int,
                          page_size: int) -> int: ...

    def indexed_elsewhere(self, group, seq: int, depth: int) -> bool: ...

    def node_page(self, group, seq: int, depth: int, own: int) -> int: ...

    def kept_runs(self, group, seq: int, depth: int, own: int, kept: int): ...

    def restore(self, group, seq: int, pages: np.ndarray, end: int, history: int,
                kept: int, page_size: int): ...


class KVRows:
    """What the kinds that store K/V rows by position share: their bytes, their storage
    planes and no per-sequence bytes (`base.LayerKind`)."""

    stores = True
    keeps_state = False
    v_in_k = False
    window = None

    def source(self, layer: int) -> int:
        return layer

    def validate(self, layer: int, config) -> None:
        """Every config serves such a layer."""

    def position_bytes(self, shape: LayerShape, itemsize: int) -> int:
        return shape.n_kv_heads * (shape.head_dim + shape.v_head_dim) * itemsize

    def planes(self, shape: LayerShape) -> tuple:
        if shape.head_dim == shape.v_head_dim:
            return (("kv", shape.head_dim),)
        return (("k", shape.head_dim), ("v", shape.v_head_dim))


def page_runs(sources, destinations, page_size: int) -> np.ndarray:
    """Row runs `[m, 3]` int32 copying whole pages `sources[i]` to `destinations[i]`:
    `(source * page_size, destination * page_size, page_size)`."""
    runs = np.empty((len(sources), 3), np.int32)
    runs[:, 0] = sources
    runs[:, 1] = destinations
    runs[:, :2] *= page_size
    runs[:, 2] = page_size
    return runs
