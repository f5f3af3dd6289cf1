"""Host page accounting of a cache's page pools (contract §4): which pages each sequence
holds, how many sequences hold each page, which pages are free, and which device
page-table entries must change. NumPy and the compiled passes of `arith.pages` only:
nothing here touches a device, so every decision is tested without one.

The layers of one page group (`config.PageGroup`: every layer paged by position, or the
ring layers of one ring size R) share page ids. Per group, `GroupPages` keeps

* `table [seq rows, table_pages]` (int32): the page ids of each sequence, in position
  order (flat: page `i` holds positions `[i P, (i + 1) P)`; ring: ring slots);
* `held [seq rows]` (int32): how many leading entries of its row a sequence holds;
* `refs [n_pages]` (int32): how many sequences hold each page (a clone shares);
* `free[:n_free]` (int32): a stack of free page ids, low ids on top;
* `owner [n_pages]` (int32): the prefix index's node holding each page, or -1
  (`prefix_index`): the index holds one reference of each page it owns, so a page is
  free (on the stack), cached (its only reference is the index's: reclaimable) or held
  (by at least one sequence).

One row per sequence slot, and with `scratch` one more, the scratch row of padding
tokens: page 0 of every group is the scratch page, held forever, and the scratch row's
entries all point at it.

What a verb does to a group's pages is its layers' kind's to say (`kinds.base.LayerKind`:
pages at claim and per step, a clone's, a rewind's, an abort's): `PageAccounting` loops
over the groups and asks each group's kind. The device keeps the same tables as slot
bases (page id times page size) in one int32 buffer, every group's table at its own
offset (`GroupPages.table_off`). What the host
changes there is queued in `pending` (flat buffer index -> slot base) until the next
upload carries it (`PageAccounting.flush`). A sequence's entries past what it holds are
never read, so releasing pages queues nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..config import CacheConfig, PageGroup
from ..errors import CapacityError
from ..arith.pages import grown_pages, release_pages


class PoolPages(NamedTuple):
    """One page group's pool (`BatchedSequenceCache.pool_pages`): `kind` ("flat layers"
    or "ring layers of R rows"), `rows` (0, or that R), its `layers`, `page_size`, pages
    `in_use` (held by sequences, the scratch page included), `free` (neither held nor
    cached: free now or by growing to `max_pages`), `allocated`, `max_pages`, and
    `cached` (held by the prefix index alone: given out, evicted, when free pages run
    short). `in_use + free + cached == max_pages`; a step can take `free + cached`."""

    kind: str
    rows: int
    layers: tuple
    page_size: int
    in_use: int
    free: int
    allocated: int
    max_pages: int
    cached: int = 0


class GroupPages:
    """The host pages of one page group (module doc): `group` (its `PageGroup`), `kind`
    (its layers' kind, which decides what verbs do to its pages), its tables, holdings,
    reference counts and free stack, its place `table_off` in the device tables, and the
    `pending` patches it shares with the other groups of its cache."""

    def __init__(self, group: PageGroup, n_rows: int, scratch: bool, page_size: int,
                 table_off: int, pending: dict):
        self.group, self.kind, self.rows, self.layers = group, group.kind, group.rows, group.layers
        self.name, self.table_pages, self.max_pages = group.name, group.table_pages, group.max_pages
        self.page_size, self.table_off, self.pending = page_size, table_off, pending
        self.scratch = int(scratch)        # page 0: the scratch row's every entry
        self.table = np.zeros((n_rows, group.table_pages), np.int32)
        self.held = np.zeros(n_rows, np.int32)
        initial = group.initial_pages
        self.refs = np.zeros(initial, np.int32)
        self.refs[:self.scratch] = 1
        self.n_free = initial - self.scratch
        self.free = np.zeros(initial, np.int32)    # popped from the end: low ids first
        self.free[:self.n_free] = np.arange(initial - 1, self.scratch - 1, -1)
        self.owner = np.full(initial, -1, np.int32)

    @property
    def n_pages(self) -> int:
        """Pages allocated."""
        return self.refs.size

    @property
    def used(self) -> int:
        """Pages off the free stack: held, cached and the scratch page."""
        return self.n_pages - self.n_free

    @property
    def cached(self) -> int:
        """Pages whose only reference is the prefix index's (reclaimable)."""
        return int(np.count_nonzero((self.owner >= 0) & (self.refs == 1)))

    @property
    def in_use(self) -> int:
        """Pages some sequence (or the scratch row) holds."""
        return self.used - self.cached

    @property
    def available(self) -> int:
        """Pages a sequence could still take: free now, by growing to `max_pages`, or
        cached (evicted from the prefix index)."""
        return self.max_pages - self.used + self.cached

    def report(self) -> PoolPages:
        cached = self.cached
        return PoolPages(self.name, self.rows, tuple(self.layers), self.page_size,
                         self.used - cached, self.max_pages - self.used, self.n_pages,
                         self.max_pages, cached)

    def check_room(self, needed: int, verb: str, unavailable: int = 0) -> None:
        """Refuse (`CapacityError`) taking `needed` pages past `max_pages`, counting cached
        pages as available but for `unavailable` of them (the prefix pages a verb is
        about to share)."""
        if needed <= self.max_pages - self.used:
            return
        cached = self.cached
        available = self.max_pages - self.used + cached - unavailable
        if needed > available:
            raise CapacityError(
                f"{verb}: the {self.name} need {needed} new pages of {self.page_size} "
                f"positions, and their pool has {available} available of max_pages "
                f"{self.max_pages} ({self.used - cached} held by sequences, {cached} cached "
                f"by the prefix index); free sequences (seq_rm), or raise max_pages")

    def grown(self, needed: int) -> int:
        """Pages the pool must have allocated for `needed` more to be free, as far as
        `max_pages` allows: its size now, or grown by doubling (`pages.grown_pages`, at
        most `max_pages`; what growth cannot give, eviction from the prefix index must)."""
        if needed <= self.n_free:
            return self.n_pages
        return grown_pages(self.n_pages, self.used + needed, self.max_pages)

    def grow(self, n_pages: int) -> None:
        """Account for storage grown to `n_pages`: the new pages are free."""
        old = self.n_pages
        refs = np.zeros(n_pages, np.int32)
        refs[:old] = self.refs
        free = np.empty(n_pages, np.int32)
        free[:self.n_free] = self.free[:self.n_free]
        free[self.n_free:self.n_free + n_pages - old] = np.arange(n_pages - 1, old - 1, -1)
        owner = np.full(n_pages, -1, np.int32)
        owner[:old] = self.owner
        self.refs, self.free, self.n_free = refs, free, self.n_free + n_pages - old
        self.owner = owner

    def take(self, n: int, refs: int = 1) -> np.ndarray:
        """Pop `n` free page ids (the caller made sure they exist), each held `refs` times
        (0: pages for the prefix index, referenced when a node adopts them)."""
        self.n_free -= n
        pages = self.free[self.n_free:self.n_free + n].copy()
        self.refs[pages] = refs
        return pages

    def hold(self, seq: int, pages: np.ndarray, first: int = 0) -> None:
        """`seq` holds `pages` from its entry `first` on (and nothing past them); their
        device-table entries are queued."""
        self.table[seq, first:first + pages.size] = pages
        self.held[seq] = first + pages.size
        base = self.table_off + seq * self.table_pages + first
        for i, page in enumerate(pages.tolist()):
            self.pending[base + i] = page * self.page_size

    def adopt(self, page: int, node: int) -> None:
        """The prefix index's `node` owns `page` and takes one reference of it."""
        self.owner[page] = node
        self.refs[page] += 1

    def disown(self, page: int) -> None:
        """The prefix index lets go of `page`: no owner, one reference less."""
        self.owner[page] = -1
        self.drop(page)

    def drop(self, page: int) -> None:
        """One reference of `page` goes (the index's); unreferenced, it is free."""
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free[self.n_free] = page
            self.n_free += 1

    def release(self, seq: int, keep: int) -> None:
        """Let `seq` hold only its first `keep` pages; a page no sequence holds any more
        goes back on the free stack."""
        self.n_free = release_pages(seq, keep, self.held, self.table, self.refs, self.free,
                                    self.n_free)

    def share(self, src: int, dst: int, n: int) -> None:
        """`dst` holds `src`'s first `n` pages too (reference counts rise); their device
        entries are copied on the device (`PageAccounting.clone`), not queued."""
        pages = self.table[src, :n]
        self.refs[pages] += 1
        self.table[dst, :n] = pages
        self.held[dst] = n

    def attach(self, seq: int, pages: np.ndarray) -> None:
        """`seq` (holding nothing in this group) holds `pages`, which others hold too
        (reference counts rise; their device-table entries are queued)."""
        self.refs[pages] += 1
        self.hold(seq, pages)

    def entry(self, seq: int) -> int:
        """The device-table index of `seq`'s first entry."""
        return self.table_off + seq * self.table_pages


class PageWork(NamedTuple):
    """Device work on the pages, as a value (a step's `claim_step`, a clone's `clone`, a
    prefix match's or registration's): the table patches `[n, 2]`
    (flat device-table index, slot base) or None; per group index, the page copies as
    row runs `[m, 3]` int32 (source slot, destination slot, rows: a whole page is
    `(source * page_size, destination * page_size, page_size)`; `kernels.moves.page_copy`)
    or None; and the shared entries to copy on the device, `(from index, to index, count)`
    or None."""

    patches: np.ndarray | None
    copies: tuple
    shared: tuple | None

    @property
    def empty(self) -> bool:
        return self.patches is None and self.shared is None and \
            all(runs is None for runs in self.copies)


#: `PageWork` made without the keyword handling of its generated `__new__` (once a step)
_work = tuple.__new__


class PageAccounting:
    """The host pages of every page group of one cache (`groups`, the one paged by
    position first; `group_of[layer]`), `n_rows` page-table rows (one per sequence slot,
    and the scratch row when `scratch`), and the device-table patches `pending` for the
    next upload. Each verb loops over the groups and asks their kinds. The verbs here
    assume what a caller checked: that the pages exist (`check_room`, then storage grown
    and `GroupPages.grow`) and the ids are valid."""

    def __init__(self, config: CacheConfig, n_rows: int, scratch: bool):
        self.config, self.n_rows, self.scratch = config, n_rows, scratch
        self.page_size = config.page_size
        self.page_bits = self.page_size.bit_length() - 1
        self.pending: dict = {}
        self.groups, self.group_of = [], [None] * config.n_layers
        offset = 0
        for group in config.page_groups:
            pages = GroupPages(group, n_rows, scratch, self.page_size, offset, self.pending)
            offset += n_rows * group.table_pages
            self.groups.append(pages)
            for layer in group.layers:
                self.group_of[layer] = pages
        for layer in range(config.n_layers):        # a shared layer: its producer's group
            self.group_of[layer] = self.group_of[config.source(layer)]
        self.table_entries = offset          # the device tables' size, int32 entries
        #: the group paged by position (flat and latent layers: FlashInfer's paged format,
        #: the pages a step takes), or None
        self.by_position = next((g for g in self.groups if not g.rows), None)
        self.no_copies = (None,) * len(self.groups)     # a `PageWork` copying no rows
        self.no_work = PageWork(None, self.no_copies, None)     # and doing nothing at all
        self.no_pages = (0,) * len(self.groups)         # a step taking no pages
        #: `(index, group)` of the groups whose pages follow positions (`kinds`:
        #: `pages_by_step`): the only ones a step, a rewind or an abort changes
        self.stepping = tuple((i, g) for i, g in enumerate(self.groups) if g.kind.pages_by_step)

    # ------------------------------------------------------------------ what verbs need
    def claim_demand(self) -> list:
        """`(group, pages)` a new sequence takes (`kinds`: `claim_pages`)."""
        return [(g, n) for g in self.groups if (n := g.kind.claim_pages(g.table_pages))]

    def clone_demand(self, keep: int) -> list:
        """`(group, pages)` a clone of `keep` positions takes (`kinds`: `clone_pages`)."""
        return [(g, n) for g in self.groups
                if (n := g.kind.clone_pages(keep, self.page_size, g.table_pages))]

    def step_demand(self, seqs: np.ndarray, totals: np.ndarray, pos: np.ndarray) -> tuple:
        """Per group, the new pages a step of sequences `seqs` (int64, distinct) writing
        `totals` tokens from `pos[seq]` takes, copy-on-write pages included (`kinds`:
        `step_pages`); `no_pages` when it takes none."""
        found = None
        for i, group in self.stepping:
            n = group.kind.step_pages(group, seqs, totals, pos)
            if n:
                if found is None:
                    found = list(self.no_pages)
                found[i] = n
        return self.no_pages if found is None else tuple(found)

    def check_step_room(self, needed: tuple, verb: str) -> None:
        """Refuse (`CapacityError`) a step whose `needed` pages (`step_demand`) some
        group's pool cannot give."""
        for i, group in self.stepping:
            if needed[i]:
                group.check_room(needed[i], verb)

    # ------------------------------------------------------------------ sequences
    def claim(self, seq: int) -> None:
        """`seq` takes the pages a new sequence holds (`claim_demand`)."""
        for group, n in self.claim_demand():
            group.hold(seq, group.take(n))

    def release(self, seq: int) -> None:
        """`seq_rm`: every page of `seq`, in every group."""
        for group in self.groups:
            group.release(seq, 0)

    def rewind(self, seq: int, position: int) -> None:
        """The pages `seq` no longer needs at `position` go (`kinds`: `rewind`)."""
        for _, group in self.stepping:
            group.kind.rewind(group, seq, position)

    def abort(self, seqs: np.ndarray, pos: np.ndarray) -> None:
        """An aborted step's sequences (int64, distinct) hold the pages of their positions
        `pos[seq]` again (`kinds`: `abort`)."""
        for _, group in self.stepping:
            group.kind.abort(group, seqs, pos)

    def claim_step(self, seqs: np.ndarray, totals: np.ndarray, pos: np.ndarray,
                   needed: tuple) -> PageWork:
        """Take a step's `needed` pages (`step_demand`), and give each sequence whose first
        write lands in a page another sequence holds a fresh page in its place. Returns
        its `PageWork`: every device-table patch due (the step's and those queued
        before), and per group the whole-page row runs (source slot, destination slot,
        rows) copy-on-write must run before the step writes."""
        if needed is self.no_pages:
            return _work(PageWork, (self.flush(None), self.no_copies, None)) if self.pending \
                else self.no_work
        patches, copies, copied = None, list(self.no_copies), False
        for i, group in self.stepping:
            if needed[i]:
                found, copies[i] = group.kind.claim_step(group, seqs, totals, pos, needed[i])
                patches = found if patches is None else np.concatenate([patches, found])
                copied = copied or copies[i] is not None
        if not copied:
            return _work(PageWork, (self.flush(patches), self.no_copies, None))
        return _work(PageWork, (self.flush(patches), tuple(copies), None))

    def clone(self, src: int, dst: int, keep: int) -> PageWork:
        """`dst` holds `src`'s first `keep` positions, each group's pages as its kind
        says (`kinds`: `clone`: shared where they can be, copied where they must). None
        of the work grows with `keep`: shared entries move as one device copy."""
        copies, shared = [], None
        for group in self.groups:
            runs, entries = group.kind.clone(group, src, dst, keep)
            copies.append(runs)
            shared = entries if entries is not None else shared
        return PageWork(self.flush(None), tuple(copies), shared)

    def flush(self, patches) -> np.ndarray | None:
        """The pending patches and `patches` (`[n, 2]`, or None) as one `[n, 2]` int32
        array (`patches` win where both name an entry), or None; nothing stays pending."""
        pending = self.pending
        if not pending:
            return patches if patches is not None and len(patches) else None
        if patches is not None:
            pending.update(zip(patches[:, 0].tolist(), patches[:, 1].tolist()))
        merged = np.array(list(pending.items()), np.int32).reshape(-1, 2)
        pending.clear()
        return merged

    # ------------------------------------------------------------------ reading
    def slots(self, layer: int, seq: int, rows: np.ndarray) -> np.ndarray:
        """The storage slots of rows `rows` (int64) of `seq` on `layer`."""
        group = self.group_of[layer]
        return group.table[seq, rows >> self.page_bits] * self.page_size + \
            (rows & (self.page_size - 1))

    def held_bytes(self) -> int:
        """Bytes of the pages live sequences hold: per group, its pages in use past the
        scratch page times a page id's bytes over its layers (a shared page once)."""
        return sum((group.in_use - int(self.scratch)) * group.group.position_bytes
                   for group in self.groups) * self.page_size

    def cached_bytes(self) -> int:
        """Bytes of the pages the prefix index alone holds."""
        return sum(group.cached * group.group.position_bytes for group in self.groups) * \
            self.page_size
