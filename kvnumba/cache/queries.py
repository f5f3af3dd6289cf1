"""The read-only face of a `BatchedSequenceCache` (contract §4, §7, §8): per-slot queries,
the pools and pages, and host copies of what a layer holds.

`CacheQueries` is the cache's base class: it reads the cache through one record,
`CacheParts` (the config, the slot table, the pools, the data path and the step
protocol), that the cache builds once, and changes nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..args import as_id, as_ids
from ..device import on_its_device
from ..errors import ConfigError
from ..arith.pages import flashinfer_tables
from ..arith.positions import held_positions
from ..host.slots import SlotState, StepState, state_refusal
from ..host.step import StepPlan
from ..protocol import IndexCounts


class PageDemand(NamedTuple):
    """What a step would take from the flat layers' pool (`page_demand`): `needed` new
    pages (copy-on-write pages included) and `free`, the pages it can still give under
    `max_pages`, cached pages included (they are evicted as needed); `declare_step`
    refuses the step when `needed > free`."""

    needed: int
    free: int



class CacheParts(NamedTuple):
    """What the queries read of a cache: its `config`, `slots` (`SlotTable`), `pool`
    (`Pool`), `data` (`DataPath`: layer ids and geometry), `steps` (`StepProtocol`:
    the step machine, the open step) and `states` (`StatePath`: the state layers' ops)."""

    config: object
    slots: object
    pool: object
    data: object
    steps: object
    states: object


class CacheQueries:
    """Queries of a `BatchedSequenceCache` (module doc) over `_parts` (`CacheParts`),
    set by the cache."""

    _parts: CacheParts

    @property
    def max_seqs(self) -> int:
        """Sequence slots handed out (ids `0 .. max_seqs - 1`)."""
        return self._parts.config.max_seqs

    @property
    def step_state(self) -> StepState:
        """`StepState.IDLE | DECLARED | PREPARED`."""
        return self._parts.steps.machine.state

    @property
    def plan(self) -> StepPlan | None:
        """The open step's plan, or None between steps."""
        return self._parts.steps.plan

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage allocated over all layers (every pool's pages)."""
        return self._parts.pool.storage.nbytes

    @property
    def nbytes_state(self) -> int:
        """Bytes of the state layers' columns allocated (contract §17: every sequence slot
        and the scratch column, `config.bytes_per_sequence` each), apart from pages."""
        return self._parts.pool.states.nbytes

    @property
    def nbytes_held(self) -> int:
        """Bytes of the pages live sequences hold over all layers, a page shared by
        clones counted once (the scratch page not at all)."""
        return self._parts.pool.nbytes_held

    @property
    def prefix_counts(self) -> IndexCounts:
        """What the prefix index holds and has given back (`IndexCounts`)."""
        index = self._parts.pool.index
        return IndexCounts(len(index), index.pages_evicted, self._parts.pool.nbytes_cached)

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def layer_data(self, layer: int):
        """`(k, v)` page pools of `layer`, `[n_pages, page_size, n_kv_heads, head_dim]`
        device arrays of the storage dtype (they move when the pool grows); V's last axis
        is its `v_head_dim`, except on a latent layer, whose `v` is its row pool itself
        (V: each row's first `v_head_dim` values); a shared layer's are its producer's."""
        layer = self._parts.data.layer(layer, "layer_data")
        return self._parts.pool.storage.k[layer], self._parts.pool.storage.v[layer]

    def pool_pages(self) -> tuple:
        """One `PoolPages` per page group (flat layers first, then each ring size): its
        layers, pages in use (held by sequences), free (under `max_pages`), allocated,
        `max_pages` and cached (held by the prefix index alone)."""
        return tuple(group.report() for group in self._parts.pool.accounting.groups)

    def page_demand(self, seq_ids) -> PageDemand:
        """How many new flat pages `declare_step(seq_ids)` would take and how many the
        pool can give, without declaring (`seq_ids`: ints or an int array `[n_tokens]`,
        as `declare_step` takes them; ring pages come with `seq_new`, never with a
        step). Changes nothing."""
        ids = as_ids(seq_ids, self._parts.config.max_seqs, "page_demand seq_ids")
        accounting = self._parts.pool.accounting
        flat = accounting.by_position
        if flat is None or ids.size == 0:
            return PageDemand(0, 0 if flat is None else flat.available)
        counts = np.bincount(ids, minlength=self._parts.config.max_seqs)
        seqs = np.flatnonzero(counts)
        needed = accounting.step_demand(seqs, counts[seqs], self._parts.slots.pos)
        return PageDemand(needed[accounting.groups.index(flat)], flat.available)

    def page_table(self, seq: int, layer: int) -> np.ndarray:
        """A host copy of the page ids `seq` holds in `layer`'s page group, in order (int32
        `[pages held]`; flat: position `p` in page `[p // page_size]`; ring: ring slot `s`
        in `[s // page_size]`)."""
        seq = self._live(self._id(seq, "page_table"), "page_table")
        group = self._parts.pool.accounting.group_of[self._parts.data.layer(layer, "page_table")]
        return group.table[seq, :group.held[seq]].copy()

    def paged_kv(self, seqs=None) -> tuple:
        """The flat layers' pages of sequences `seqs` in FlashInfer's paged-KV format:
        `(kv_indptr [n + 1], kv_indices [nnz], kv_last_page_len [n])`, int32 host arrays
        over any flat layer's pools (`layer_data`, NHD layout; all flat layers share
        page ids).

        `seqs` None: the prepared step's sequences, in the order of their first spans,
        each described through the positions the step writes (`pos` + its tokens);
        given (ids), between steps or in a step, each through the positions it holds now.
        """
        flat = self._parts.pool.accounting.by_position
        if flat is None:
            raise ConfigError("paged_kv: the cache has no flat layers (ring layers are "
                              "rings of pages, not FlashInfer's paged format)")
        pos = self._parts.slots.pos
        if seqs is None:
            step = self._parts.steps.prepared("paged_kv")
            span_seqs = step.spans[0]
            ids = span_seqs[np.sort(np.unique(span_seqs, return_index=True)[1])]
            written = np.zeros(self._parts.config.max_seqs, np.int64)
            written[step.seqs] = step.totals            # its sequences are distinct
            lengths = pos[ids] + written[ids]
        else:
            ids = as_ids(seqs, self._parts.config.max_seqs, "paged_kv seqs")
            for seq in ids[self._parts.slots.state[ids] == SlotState.FREE][:1].tolist():
                self._live(seq, "paged_kv")
            lengths = pos[ids]
        return flashinfer_tables(flat.table, ids, lengths.astype(np.int64), self.page_size)

    def pos(self, seq: int) -> int:
        """Positions the sequence holds (the next token takes this position)."""
        return int(self._parts.slots.pos[self._id(seq, "pos")])

    def high_water(self, seq: int) -> int:
        """Most positions ever written into the sequence's storage since it was claimed."""
        return int(self._parts.slots.high_water[self._id(seq, "high_water")])

    def state(self, seq: int) -> SlotState:
        """The sequence slot's lifecycle state."""
        return SlotState(int(self._parts.slots.state[self._id(seq, "state")]))

    def floor(self, seq: int) -> int:
        """Lowest position the sequence can rewind or be cloned to (0 without ring layers)."""
        return self._floor(self._id(seq, "floor"))

    def _floor(self, seq: int) -> int:
        return self._parts.config.floor_of(int(self._parts.slots.high_water[seq]))[0]

    @on_its_device
    def sequence_kv(self, seq: int, layer: int):
        """`(positions [n] int64, k, v [n, n_kv_heads, head_dim])`: host copies of what
        `layer` still holds for `seq`, in position order (k, v in the storage dtype,
        bfloat16 as `ml_dtypes.bfloat16`).

        Flat layers: positions `[0, pos)`; ring layers: `[max(0, hw - R), pos)`.
        """
        seq = self._live(self._id(seq, "sequence_kv"), "sequence_kv")
        layer = self._parts.data.layer(layer, "sequence_kv")
        ring = self._parts.data.layer_geometry[layer][0]
        start, stop = held_positions(int(self._parts.slots.pos[seq]),
                                     int(self._parts.slots.high_water[seq]), ring)
        positions = np.arange(start, stop, dtype=np.int64)
        rows = positions % ring if ring else positions
        slots = self._parts.pool.accounting.slots(layer, seq, rows)
        return (positions, *self._parts.pool.storage.read(layer, slots, self.config.np_dtype))

    def _id(self, seq, verb: str) -> int:
        return as_id(seq, self._parts.config.max_seqs, verb)

    def _live(self, seq: int, verb: str) -> int:
        """`seq`, or `FreeSequenceError` when no live sequence holds the slot: its data
        reads (pages, K/V) are refused, its per-slot queries answer for a free slot."""
        if self._parts.slots.state[seq] == SlotState.FREE:
            raise state_refusal(seq, SlotState.FREE, f"{verb} of its data",
                                [s.name for s in SlotState if s != SlotState.FREE])
        return seq

