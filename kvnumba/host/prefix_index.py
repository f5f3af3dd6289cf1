"""The prefix index's host side (contract §14): which committed pages it remembers, under
which keys, and which it gives back when pages run short. NumPy only, over a cache's
`PageAccounting`: nothing here touches a device.

A node is one whole page of positions `[d P, (d + 1) P)` of some registered sequence,
`d` its depth, found by its key (`prefix_keys`: a chained digest of every token up to
the page's end and the caller's extra key). It owns one page of every layer kind:

* flat layers: the sequence's own page, shared (the index holds one reference, as a
  clone does; a later write into it copies it first);
* each ring kind (R rows): a page of the index's own holding the node's positions by
  absolute position (position `p` at row `p % P`), copied out of the sequence's ring when
  the page was registered. Only the rows a later match can need are copied: the last
  `min(P, W - 1)` positions of the page (a match at a page boundary `L` needs `[L - W + 1,
  L)`), or the whole page for a ring no shorter than the cache's capacity (it never
  wraps, and a resumed sequence reads all of it).

A page whose only reference is the index's is cached: reclaimable. Pages are taken free
first (a pool grows as far as its `max_pages` allows); when a pool is short even so,
cached pages are evicted by node, least recently used first (a node is used when it is registered or matched; all nodes of one call share
the use), the deepest of equally recent ones before their parents. A node whose page of
the kind is still held by a sequence frees nothing there and is passed over. Evicting a
node drops its keys' reachability below it too (a match walks keys from the root), but
not its children's pages: those stay cached until their own turn, and match again if
the parent is registered again.
"""
from __future__ import annotations

import numpy as np

from .page_accounting import PageAccounting
from .positions import ring_history, ring_runs

#: nodes the index starts with room for (it doubles as needed)
INITIAL_NODES = 64


class PrefixIndex:
    """The index of one cache's pages (module doc), over `accounting` (its
    `PageAccounting`, the one writer of reference counts and owners: the index asks it).

    `pages_evicted`: nodes (pages of positions) given back so far."""

    def __init__(self, accounting: PageAccounting):
        self.accounting = accounting
        self.kinds = accounting.kinds
        config, size = accounting.config, accounting.page_size
        self.page_size = size
        # per kind: positions before a resume point its layers read (0: flat, all held)
        self.history = [ring_history(k.rows, config.max_write, config.capacity) if k.rows
                        else 0 for k in self.kinds]
        # per kind: rows of each page of positions a node keeps (flat: the shared page)
        self.kept = [min(size, h) if k.rows else size
                     for k, h in zip(self.kinds, self.history)]
        self.nodes: dict[bytes, int] = {}     # key -> node
        self.tick = 0
        self.pages_evicted = 0
        # per node: its page of each kind (-1: none), last use, depth, key
        self.node_pages = np.full((0, len(self.kinds)), -1, np.int32)
        self.used = np.zeros(0, np.int64)
        self.depth = np.zeros(0, np.int64)
        self.keys: list = []
        self.spare: list = []                   # unused node ids, popped from the end
        self._grow(INITIAL_NODES)

    def _grow(self, n: int) -> None:
        """Room for `n` nodes."""
        old = len(self.keys)
        self.node_pages = np.concatenate(
            [self.node_pages, np.full((n - old, len(self.kinds)), -1, np.int32)])
        self.used = np.concatenate([self.used, np.zeros(n - old, np.int64)])
        self.depth = np.concatenate([self.depth, np.zeros(n - old, np.int64)])
        self.keys += [None] * (n - old)
        self.spare = list(range(n - 1, old - 1, -1)) + self.spare

    def __len__(self) -> int:
        return len(self.nodes)

    # ------------------------------------------------------------------ reading
    def match(self, keys) -> int:
        """How many leading `keys` are indexed (the pages a match shares)."""
        nodes = self.nodes
        for i, key in enumerate(keys):
            if key not in nodes:
                return i
        return len(keys)

    def chain(self, keys) -> np.ndarray:
        """The nodes of `keys` (every one indexed), int64 `[len(keys)]`."""
        return np.array([self.nodes[key] for key in keys], np.int64)

    def touch(self, nodes) -> int:
        """Mark `nodes` used now (one use for all of them); returns the use's tick."""
        self.tick += 1
        self.used[nodes] = self.tick
        return self.tick

    def page_of(self, node: int, kind: int) -> int:
        return int(self.node_pages[node, kind])

    def cached_in(self, kind: int, nodes) -> int:
        """Cached pages of kind `kind` that `nodes` own (what evicting them would free)."""
        pages = self.node_pages[np.asarray(nodes, np.int64), kind]
        pages = pages[pages >= 0]
        return int(np.count_nonzero(self.kinds[kind].refs[pages] == 1))

    # ------------------------------------------------------------------ changing
    def add(self, key: bytes, depth: int, pages: list) -> int:
        """A node for `key` at `depth` owning `pages` (one page id per kind, -1 for none;
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
                self.kinds[i].adopt(page, node)
        return node

    def drop(self, node: int) -> None:
        """Forget `node`: the index lets go of its pages (unreferenced ones are free)."""
        for i, kind in enumerate(self.kinds):
            page = int(self.node_pages[node, i])
            if page >= 0:
                kind.disown(page)
        self.node_pages[node] = -1
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

    def evict(self, kind: int, count: int, protect=()) -> None:
        """Free `count` pages of kind `kind` by evicting nodes (module doc: least recently
        used first, deepest first among equals), never one of the nodes `protect`. The
        caller made sure enough are cached."""
        live = np.array(list(self.nodes.values()), np.int64)
        pages = self.node_pages[live, kind]
        pool = self.kinds[kind]
        frees = (pages >= 0) & (pool.refs[np.maximum(pages, 0)] == 1) & \
            ~np.isin(live, np.asarray(protect, np.int64))
        candidates = live[frees]
        order = np.lexsort((-self.depth[candidates], self.used[candidates]))
        for node in candidates[order[:count]].tolist():
            self.drop(node)
            self.pages_evicted += 1

    # ------------------------------------------------------------------ sequences
    def first_registrable(self, pos: int, high_water: int) -> int:
        """The first page of positions whose kept rows a sequence at `pos` with
        `high_water` still holds on every ring kind (its ring keeps `[hw - R, pos)`)."""
        size, first = self.page_size, 0
        for kind, kept in zip(self.kinds, self.kept):
            if kind.rows and kept:
                lowest = max(0, high_water - kind.rows)
                first = max(first, -(-(lowest + kept) // size) - 1)
        return first

    def keeps_rows(self, i: int) -> bool:
        """Whether nodes own a page of kind `i` of their own (a ring kind keeping rows)."""
        return bool(self.kinds[i].rows and self.kept[i])

    def plan_register(self, seq: int, keys: list, first: int) -> tuple:
        """`(chain, new)` of registering sequence `seq`'s pages of positions `0 ..
        len(keys) - 1` under `keys`: the nodes already indexed among them, and the depths
        of the pages to index, in order: those after the last indexed one that the
        sequence can still give (none below `first`, whose ring rows are gone; none whose
        flat page the index holds under another key) and the ring pools can give a page
        for without evicting the chain's own."""
        nodes, flat = self.nodes, self.accounting.flat
        chain, new = [], []
        for depth, key in enumerate(keys):
            node = nodes.get(key)
            if node is not None:
                chain.append(node)
                continue
            if depth < first or (flat is not None and flat.owner[flat.table[seq, depth]] >= 0):
                break
            new.append(depth)
        budget = len(new)
        for i, kind in enumerate(self.kinds):
            if self.keeps_rows(i) and budget:
                budget = min(budget, kind.available - self.cached_in(i, chain))
        return chain, new[:budget]

    def register(self, seq: int, keys: list, chain: list, new: list) -> tuple:
        """Index the pages `plan_register` planned (the ring pools hold a free page per new
        node on every kind that keeps rows): the chain's nodes are used now, each new node
        shares the flat page and takes a ring page per kind. Returns `(leading keys
        indexed, row runs per kind [m, 3] (ring slot, node slot, rows) or None)`: the ring
        rows to copy."""
        size = self.page_size
        copies = [None] * len(self.kinds)
        self.touch(chain)       # a new use, whether or not it touches indexed nodes
        owned = {}           # kind -> the pages new nodes take of it, in `new`'s order
        for i, kind in enumerate(self.kinds):
            if not (self.keeps_rows(i) and new):
                continue
            owned[i] = pages = kind.take(len(new), refs=0)   # referenced by their nodes
            runs = [ring_runs((d + 1) * size - self.kept[i], (d + 1) * size, kind.rows, size,
                              kind.table[seq], pages[j:j + 1], d) for j, d in enumerate(new)]
            copies[i] = np.ascontiguousarray(np.concatenate(runs)[:, [1, 0, 2]])
        for j, depth in enumerate(new):
            self.add(keys[depth], depth,
                     [int(kind.table[seq, depth]) if not kind.rows else
                      int(owned[i][j]) if i in owned else -1
                      for i, kind in enumerate(self.kinds)])
        return self.match(keys), copies

    def share(self, seq: int, keys: list) -> list:
        """Sequence `seq` (holding its rings, nothing else yet) takes the first
        `len(keys)` pages of positions from the index (every key indexed): it shares
        their flat pages (queued as table patches), and each ring kind gets back the rows
        its layers read before the match point. Returns the row runs per kind `[m, 3]`
        (node slot, ring slot, rows), or None, to copy."""
        chain = self.chain(keys)
        self.touch(chain)
        size, n = self.page_size, len(keys)
        end = n * size
        copies = [None] * len(self.kinds)
        for i, kind in enumerate(self.kinds):
            pages = self.node_pages[chain, i]
            if not kind.rows:
                kind.attach(seq, pages)
            elif self.kept[i]:
                start = max(0, end - self.history[i])
                copies[i] = ring_runs(start, end, kind.rows, size, kind.table[seq],
                                      pages[start // size:], start // size)
        return copies
