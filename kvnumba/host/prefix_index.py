"""The prefix index's host side (contract §14): which committed pages it remembers, under
which keys, and which it gives back when pages run short. NumPy only, over a cache's
`PageAccounting`: nothing here touches a device.

A node is one whole page of positions `[d P, (d + 1) P)` of some registered sequence,
`d` its depth, found by its key (`prefix_keys`: a chained digest of every token up to
the page's end and the caller's extra key). It owns a page of every page group, as the
group's kind says (`kinds.base.LayerKind`: `history`, `kept_rows`, `node_page`,
`kept_runs`, `restore`):

* the group paged by position (`kinds.flat`): the sequence's own page, shared (the index
  holds one reference, as a clone does; a later write into it copies it first);
* each ring group (R rows, `kinds.ring`): a page of the index's own holding the node's
  positions by absolute position (position `p` at row `p % P`), copied out of the
  sequence's ring when the page was registered. Only the rows a later match can need are
  copied: the last `min(P, W - 1)` positions of the page (a match at a page boundary `L`
  needs `[L - W + 1, L)`), or the whole page for a ring no shorter than the cache's
  capacity (it never wraps, and a resumed sequence reads all of it).

A page whose only reference is the index's is cached: reclaimable. A cache with state layers (contract §17) keeps prefix snapshots too: a node may own a
snapshot slot (`snap`) holding every state layer's state and conv window at the node's
page end. A match ends at the deepest node of its chain that owns one (`snapshotted`).
A registration snapshots its last whole page and every `snapshot_interval` positions,
where the sequence can still rebuild them (`plan_captures`), and lets go of the snapshots
its chain held off that grid before its new last page. A dropped node frees its slot.

Pages are taken free
first (a pool grows as far as its `max_pages` allows); when a pool is short even so,
cached pages are evicted by node, least recently used first (a node is used when it is
registered or matched; all nodes of one call share the use), the deepest of equally
recent ones before their parents. A node whose page of the group is still held by a
sequence frees nothing there and is passed over. Evicting a
node drops its keys' reachability below it too (a match walks keys from the root), but
not its children's pages: those stay cached until their own turn, and match again if
the parent is registered again. A cache of state layers alone has no page groups: its
nodes own only their keys and snapshots, and no pool bounds them, so the index holds at
most `max_nodes` (as many pages as a flat layer's pool would), dropping the least
recently used first to register more.
"""
from __future__ import annotations

import numpy as np

from .page_accounting import PageAccounting

#: nodes the index starts with room for (it doubles as needed)
INITIAL_NODES = 64


class PrefixIndex:
    """The index of one cache's pages (module doc), over `accounting` (its
    `PageAccounting`, the one writer of reference counts and owners: the index asks it).

    `pages_evicted`: nodes (pages of positions) given back so far."""

    def __init__(self, accounting: PageAccounting):
        self.accounting = accounting
        self.groups = accounting.groups
        config, size = accounting.config, accounting.page_size
        self.page_size = size
        # per group: positions before a resume point its layers read (0: all held)
        self.history = [g.kind.history(g.rows, config.max_write, config.capacity)
                        for g in self.groups]
        # per group: rows of each page of positions a node keeps on a page of its own
        # (0: it owns none, it shares the sequence's)
        self.kept = [g.kind.kept_rows(size, h) for g, h in zip(self.groups, self.history)]
        self.nodes: dict[bytes, int] = {}     # key -> node
        self.tick = 0
        self.pages_evicted = 0
        # per node: its page of each group (-1: none), last use, depth, key
        self.node_pages = np.full((0, len(self.groups)), -1, np.int32)
        self.used = np.zeros(0, np.int64)
        self.depth = np.zeros(0, np.int64)
        self.keys: list = []
        self.spare: list = []                   # unused node ids, popped from the end
        #: per node its snapshot slot (-1: none); free slots; slots ever made
        self.snap = np.full(0, -1, np.int64)
        self.free_slots: list = []
        self.slots_made = 0
        self.snapshots = bool(config.state_layers)
        self.interval = config.snapshot_interval if self.snapshots else 0
        #: the most nodes a cache of state layers alone indexes (its nodes own no page,
        #: so no pool bounds them): as many as a flat group's pool would hold
        self.max_nodes = None if self.groups else config.max_seqs * config.table_pages(0)
        self.max_write = config.max_write
        self._grow(INITIAL_NODES)

    def _grow(self, n: int) -> None:
        """Room for `n` nodes."""
        old = len(self.keys)
        self.node_pages = np.concatenate(
            [self.node_pages, np.full((n - old, len(self.groups)), -1, np.int32)])
        self.used = np.concatenate([self.used, np.zeros(n - old, np.int64)])
        self.depth = np.concatenate([self.depth, np.zeros(n - old, np.int64)])
        self.snap = np.concatenate([self.snap, np.full(n - old, -1, np.int64)])
        self.keys += [None] * (n - old)
        self.spare = list(range(n - 1, old - 1, -1)) + self.spare

    def __len__(self) -> int:
        return len(self.nodes)

    # ------------------------------------------------------------------ reading
    def indexed(self, keys) -> int:
        """How many leading `keys` are indexed."""
        nodes = self.nodes
        for i, key in enumerate(keys):
            if key not in nodes:
                return i
        return len(keys)

    def match(self, keys) -> int:
        """How many leading `keys` a match shares: those indexed, up to the deepest
        snapshot where the cache has state layers."""
        found = self.indexed(keys)
        if self.snapshots and found:
            return self.snapshotted(self.chain(keys[:found]))
        return found

    def snapshotted(self, chain) -> int:
        """The length of `chain` up to its deepest node owning a snapshot (0: none)."""
        owned = np.flatnonzero(self.snap[np.asarray(chain, np.int64)] >= 0)
        return int(owned[-1]) + 1 if owned.size else 0

    def chain(self, keys) -> np.ndarray:
        """The nodes of `keys` (every one indexed), int64 `[len(keys)]`."""
        return np.array([self.nodes[key] for key in keys], np.int64)

    def touch(self, nodes) -> int:
        """Mark `nodes` used now (one use for all of them); returns the use's tick."""
        self.tick += 1
        self.used[nodes] = self.tick
        return self.tick

    def page_of(self, node: int, group: int) -> int:
        return int(self.node_pages[node, group])

    def cached_in(self, group: int, nodes) -> int:
        """Cached pages of group `group` that `nodes` own (what evicting them would
        free)."""
        pages = self.node_pages[np.asarray(nodes, np.int64), group]
        pages = pages[pages >= 0]
        return int(np.count_nonzero(self.groups[group].refs[pages] == 1))

    # ------------------------------------------------------------------ changing
    def add(self, key: bytes, depth: int, pages: list) -> int:
        """A node for `key` at `depth` owning `pages` (one page id per group, -1 for none;
        the index takes one reference of each); returns it."""
        if not self.spare:
            self._grow(2 * len(self.keys))
        node = self.spare.pop()
        self.nodes[key] = node
        self.keys[node], self.depth[node] = key, depth
        self.used[node] = self.tick
        for i, page in enumerate(pages):
            self.node_pages[node, i] = page
            if page >= 0:
                self.groups[i].adopt(page, node)
        return node

    def drop(self, node: int) -> None:
        """Forget `node`: the index lets go of its pages (unreferenced ones are free)."""
        for i, group in enumerate(self.groups):
            page = int(self.node_pages[node, i])
            if page >= 0:
                group.disown(page)
        self.node_pages[node] = -1
        if self.snap[node] >= 0:
            self.free_slots.append(int(self.snap[node]))
            self.snap[node] = -1
        del self.nodes[self.keys[node]]
        self.keys[node] = None
        self.spare.append(node)

    def forget(self, keys) -> int:
        """Forget the nodes of `keys` that are indexed; returns how many."""
        nodes = [self.nodes[key] for key in keys if key in self.nodes]
        for node in nodes:
            self.drop(node)
        return len(nodes)

    def clear(self) -> int:
        """Forget every node; returns how many."""
        return self.forget(list(self.nodes))

    def evict(self, group: int, count: int, protect=()) -> None:
        """Free `count` pages of group `group` by evicting nodes (module doc: least recently
        used first, deepest first among equals), never one of the nodes `protect`. The
        caller made sure enough are cached."""
        live = np.array(list(self.nodes.values()), np.int64)
        pages = self.node_pages[live, group]
        pool = self.groups[group]
        frees = (pages >= 0) & (pool.refs[np.maximum(pages, 0)] == 1) & \
            ~np.isin(live, np.asarray(protect, np.int64))
        self._drop_oldest(live[frees], count)

    def _drop_oldest(self, candidates: np.ndarray, count: int) -> None:
        """Drop `count` of `candidates` (nodes), least recently used first, deepest first
        among equals."""
        order = np.lexsort((-self.depth[candidates], self.used[candidates]))
        for node in candidates[order[:count]].tolist():
            self.drop(node)
            self.pages_evicted += 1

    def _make_room(self, n: int, protect) -> None:
        """Room for `n` more nodes within `max_nodes` (a cache of state layers alone),
        the oldest nodes but `protect` dropped."""
        if self.max_nodes is None or len(self.nodes) + n <= self.max_nodes:
            return
        live = np.array(list(self.nodes.values()), np.int64)
        others = live[~np.isin(live, np.asarray(protect, np.int64))]
        self._drop_oldest(others, len(self.nodes) + n - self.max_nodes)

    # ------------------------------------------------------------------ sequences
    def first_registrable(self, pos: int, high_water: int) -> int:
        """The first page of positions whose kept rows a sequence at `pos` with
        `high_water` still holds in every group (`kinds`: `first_registrable`; a ring
        keeps `[hw - R, pos)`; with no page group, a cache of state layers alone, the
        first: its nodes own no page, only snapshots)."""
        return max((g.kind.first_registrable(high_water, g.rows, kept, self.page_size)
                    for g, kept in zip(self.groups, self.kept)), default=0)

    def keeps_rows(self, i: int) -> bool:
        """Whether nodes own a page of group `i` of their own (a ring keeping rows)."""
        return self.kept[i] > 0

    def plan_register(self, seq: int, keys: list, first: int) -> tuple:
        """`(chain, new)` of registering sequence `seq`'s pages of positions `0 ..
        len(keys) - 1` under `keys`: the nodes already indexed among them, and the depths
        of the pages to index, in order: those after the last indexed one that the
        sequence can still give (none below `first`, whose ring rows are gone; none whose
        page the index holds under another key: `kinds`: `indexed_elsewhere`) and the
        pools of the groups that keep rows can give a page for without evicting the
        chain's own (in a cache of state layers alone, as many as `max_nodes` holds
        beside the chain)."""
        nodes, groups = self.nodes, self.groups
        chain, new = [], []
        for depth, key in enumerate(keys):
            node = nodes.get(key)
            if node is not None:
                chain.append(node)
                continue
            if depth < first or any(g.kind.indexed_elsewhere(g, seq, depth) for g in groups):
                break
            new.append(depth)
        budget = len(new) if self.max_nodes is None else \
            min(len(new), self.max_nodes - len(chain))
        for i, group in enumerate(groups):
            if self.keeps_rows(i) and budget:
                budget = min(budget, group.available - self.cached_in(i, chain))
        return chain, new[:budget]

    def register(self, seq: int, keys: list, chain: list, new: list) -> tuple:
        """Index the pages `plan_register` planned (the pools of the groups that keep rows
        hold a free page per new node; in a cache of state layers alone the oldest nodes
        off the chain dropped past `max_nodes`): the chain's nodes are used now, each new node
        owns a page of every group (`kinds`: `node_page`: the sequence's page shared, or
        one of its own with the kept rows copied in, `kept_runs`). Returns `(leading keys
        indexed, row runs per group [m, 3] (sequence slot, node slot, rows) or None)`:
        the rows to copy."""
        copies = [None] * len(self.groups)
        self.touch(chain)       # a new use, whether or not it touches indexed nodes
        self._make_room(len(new), chain)
        owned = [np.full(len(new), -1, np.int32)] * len(self.groups)   # own pages, by group
        for i, group in enumerate(self.groups):
            if not (self.keeps_rows(i) and new):
                continue
            owned[i] = pages = group.take(len(new), refs=0)   # referenced by their nodes
            copies[i] = np.ascontiguousarray(np.concatenate(
                [group.kind.kept_runs(group, seq, d, int(pages[j]), self.kept[i])
                 for j, d in enumerate(new)]))
        for j, depth in enumerate(new):
            self.add(keys[depth], depth,
                     [group.kind.node_page(group, seq, depth, int(owned[i][j]))
                      for i, group in enumerate(self.groups)])
        return self.indexed(keys), copies

    def share(self, seq: int, keys: list) -> list:
        """Sequence `seq` (holding what a new sequence holds, nothing else yet) takes the
        first `len(keys)` pages of positions from the index (every key indexed), each
        group as its kind says (`kinds`: `restore`): the pages paged by position shared
        (queued as table patches), each ring given back the rows its layers read before
        the match point. Returns the row runs per group `[m, 3]` (node slot, ring slot,
        rows), or None, to copy."""
        chain = self.chain(keys)
        self.touch(chain)
        size, n = self.page_size, len(keys)
        end = n * size
        copies = [None] * len(self.groups)
        for i, group in enumerate(self.groups):
            copies[i] = group.kind.restore(group, seq, self.node_pages[chain, i], end,
                                           self.history[i], self.kept[i], size)
        return copies

    def plan_captures(self, keys: list, pos: int, high_water: int, base: int) -> np.ndarray:
        """The snapshots registering `keys` (all indexed) of a sequence at `pos` with
        `high_water` and state base position `base` takes (module doc): `(col unset, E,
        slot)` rows `[n, 3]` int32 for its last page and the grid's pages that have none
        and that it can rebuild (`base <= E`, `high_water - max_write <= E <= pos`), slots
        taken; the chain's earlier off-grid snapshots are let go."""
        size, chain = self.page_size, self.chain(keys).tolist()
        tip = len(keys) - 1
        lowest = max(base, high_water - self.max_write)
        caps = []
        for depth, node in enumerate(chain):
            end = (depth + 1) * size
            if self.snap[node] < 0 and (depth == tip or end % self.interval == 0) and \
                    lowest <= end <= pos:
                self.snap[node] = slot = self._take_slot()
                caps.append((0, end, slot))
        if chain and self.snap[chain[-1]] >= 0:      # the new last page holds one
            for depth, node in enumerate(chain[:-1]):
                if self.snap[node] >= 0 and (depth + 1) * size % self.interval:
                    self.free_slots.append(int(self.snap[node]))
                    self.snap[node] = -1
        return np.array(caps, np.int32).reshape(-1, 3)

    def _take_slot(self) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        self.slots_made += 1
        return self.slots_made - 1

    @property
    def n_snapshots(self) -> int:
        """Snapshots the index holds."""
        return self.slots_made - len(self.free_slots)
