"""Host page accounting (`kvnumba.host.page_accounting`) on its own: no device, no kernel, no
simulated launch. A hand-worked scenario with every page id written down, and a long
random run checked against an independent model of which sequences share which page."""
import numpy as np
import pytest

import kvnumba as kv
from kvnumba.host.page_accounting import PageAccounting
from kvnumba.arith.pages import pages_for

P = 8


def config(**kw):
    base = dict(layers=[kv.flat(), kv.ring(window=5)], n_kv_heads=1, head_dim=8, capacity=64,
                max_seqs=3, max_write=4, max_step=8, page_size=P, initial_pages=64)
    return kv.CacheConfig(**{**base, **kw})


def check_consistent(pages: PageAccounting):
    """Reference counts are the holdings (the scratch page held once), the free stack is
    exactly the pages nobody holds, each once."""
    for group in pages.groups:
        counts = np.zeros(group.n_pages, np.int64)
        for seq in range(pages.n_rows):
            np.add.at(counts, group.table[seq, :group.held[seq]], 1)
        counts[0] += group.scratch
        assert (counts == group.refs).all(), group.name
        free = group.free[:group.n_free]
        assert len(set(free.tolist())) == free.size
        assert set(free.tolist()) == set(np.flatnonzero(group.refs == 0).tolist())


def step(pages, pos, seqs, totals):
    """A step's pages, as `prepare_step` takes them; then positions advance. Returns the
    pages taken, the table patches and the flat group's row copies (None for none)."""
    seqs, totals = np.asarray(seqs, np.int64), np.asarray(totals, np.int64)
    needed = pages.step_demand(seqs, totals, pos)
    assert not any(needed[1:])                    # a ring's pages come with its sequence
    work = pages.claim_step(seqs, totals, pos, needed)
    assert work.shared is None and all(runs is None for runs in work.copies[1:])
    pos[seqs] += totals
    return needed[0], work.patches, work.copies[0]


def test_a_hand_worked_life_of_pages():
    pages = PageAccounting(config(), n_rows=4, scratch=True)   # 3 slots + the scratch row
    flat, ring = pages.groups
    assert (flat.table_pages, ring.table_pages, ring.rows) == (8, 1, 8)   # R = 5 + 4 - 1
    pos = np.zeros(4, np.int64)
    pages.claim(0)                                # the lowest free page: 1 (0 is scratch)
    assert ring.table[0, 0] == 1 and pages.pending == {ring.entry(0): 1 * P}
    needed, patches, copies = step(pages, pos, [0], [4])
    needed2, patches2, copies2 = step(pages, pos, [0], [4])
    needed3, patches3, _ = step(pages, pos, [0], [4])      # positions 0..11: pages 1, 2
    assert (needed, needed2, needed3) == (1, 0, 1)
    assert patches.tolist() == [[ring.entry(0), 1 * P], [flat.entry(0), 1 * P]]
    assert patches2 is None and copies2 is None and copies is None
    assert patches3.tolist() == [[flat.entry(0) + 1, 2 * P]]
    assert flat.table[0, :flat.held[0]].tolist() == [1, 2]
    check_consistent(pages)

    work = pages.clone(0, 1, 10)                  # page 1 shared, page 2 straddles 10: copied
    assert flat.table[1, :flat.held[1]].tolist() == [1, 3]
    assert flat.refs[1] == 2 and work.shared == (flat.entry(0), flat.entry(1), 1)
    # whole pages as row runs (source slot, destination slot, rows)
    assert work.copies[0].tolist() == [[2 * P, 3 * P, P]]
    assert work.copies[1].tolist() == [[1 * P, 2 * P, P]]
    assert all(c.dtype == np.int32 for c in work.copies)
    assert work.patches.tolist() == [[flat.entry(1) + 1, 3 * P], [ring.entry(1), 2 * P]]
    pos[1] = 10
    check_consistent(pages)

    pages.rewind(1, 6)                            # page 3 (positions 8..) goes back
    pos[1] = 6
    assert flat.held[1] == 1 and flat.refs[3] == 0
    needed, patches, copies = step(pages, pos, [1], [1])   # writes into shared page 1
    new = flat.table[1, 0]
    assert needed == 1 and new not in (1, 2) and copies.tolist() == [[1 * P, new * P, P]]
    assert copies.dtype == np.int32
    assert flat.refs[1] == 1 and flat.refs[new] == 1
    assert patches.tolist() == [[flat.entry(1), new * P]]
    check_consistent(pages)

    pages.release(0)                              # sequence 0's pages all go
    assert flat.refs[1] == flat.refs[2] == 0 and ring.refs[1] == 0
    check_consistent(pages)
    assert flat.in_use == 2 and ring.in_use == 2  # scratch + sequence 1's


def test_a_step_past_max_pages_is_refused_naming_the_numbers():
    pages = PageAccounting(config(initial_pages=3, max_pages=3), n_rows=4, scratch=True)
    seqs, totals, pos = np.array([0]), np.array([4]), np.array([16, 0, 0, 0])
    needed = pages.step_demand(seqs, totals, pos)
    assert needed == (3, 0)                       # positions 0..19: 3 flat pages
    with pytest.raises(kv.CapacityError, match=r"need 3 new pages of 8 positions, and their "
                                               r"pool has 2 available of max_pages 3"):
        pages.check_step_room(needed, "declare_step")


def test_growth_keeps_the_held_pages_and_frees_the_new_ones_low_first():
    pages = PageAccounting(config(initial_pages=2), n_rows=4, scratch=True)
    flat = pages.by_position
    pos = np.zeros(4, np.int64)
    step(pages, pos, [0], [4])
    # 2 pages, both held (scratch, sequence 0): doubling, or what is needed past it
    assert (flat.grown(0), flat.grown(2), flat.grown(3)) == (2, 4, 5)
    flat.grow(4)
    assert [flat.take(1).tolist(), flat.take(1).tolist()] == [[2], [3]]   # low ids first
    assert flat.refs.tolist() == [1, 1, 1, 1] and flat.n_free == 0


class Model:
    """Which sequences share each page, as the contract says: a clone shares the pages
    wholly below its cut, a write into a shared page gets a copy, a rewind and seq_rm let
    pages go. Pages are tokens here, not ids."""

    def __init__(self):
        self.pages = {}
        self.next = 0

    def fresh(self):
        self.next += 1
        return self.next

    def holders(self, token):
        return sum(token in pages for pages in self.pages.values())

    def write(self, seq, pos, n):
        pages = self.pages.setdefault(seq, [])
        if pos % P and self.holders(pages[pos // P]) > 1:
            pages[pos // P] = self.fresh()
        while len(pages) < pages_for(pos + n, P):
            pages.append(self.fresh())


def test_random_verbs_share_exactly_what_the_model_shares():
    rng = np.random.default_rng(7)
    cfg = config(layers=[kv.flat()], max_seqs=5, max_write=6, max_step=30, capacity=120,
                 initial_pages=4)
    pages = PageAccounting(cfg, n_rows=6, scratch=True)
    flat = pages.by_position
    model = Model()
    pos = np.zeros(6, np.int64)
    live = set()
    copied = shared = 0           # the run must meet copy-on-write and shared pages
    for _ in range(2000):
        verb = rng.choice(["new", "step", "clone", "rewind", "rm"],
                          p=[0.1, 0.35, 0.2, 0.25, 0.1])
        free = [s for s in range(5) if s not in live]
        if verb == "new" and free:
            live.add(free[0])
            model.pages[free[0]] = []
        elif verb == "step" and live:
            seqs = np.array(sorted(rng.choice(sorted(live), rng.integers(1, len(live) + 1),
                                              replace=False)), np.int64)
            totals = rng.integers(1, 7, seqs.size).astype(np.int64)
            totals = np.minimum(totals, 120 - pos[seqs])
            keep = totals > 0
            seqs, totals = seqs[keep], totals[keep]
            if not seqs.size:
                continue
            needed = pages.step_demand(seqs, totals, pos)[0]
            flat.grow(flat.grown(needed))
            for seq, n in zip(seqs.tolist(), totals.tolist()):
                model.write(seq, int(pos[seq]), n)
            copies = step(pages, pos, seqs, totals)[2]
            copied += 0 if copies is None else len(copies)
        elif verb == "clone" and free and any(pos[s] for s in live):
            src = int(rng.choice([s for s in live if pos[s]]))
            keep = int(rng.integers(1, pos[src] + 1))
            flat.grow(flat.grown(1))
            pages.clone(src, free[0], keep)
            n_shared = keep // P
            model.pages[free[0]] = model.pages[src][:n_shared] + \
                ([model.fresh()] if keep % P else [])
            pos[free[0]] = keep
            live.add(free[0])
        elif verb == "rewind" and live:
            seq = int(rng.choice(sorted(live)))
            to = int(rng.integers(0, pos[seq] + 1))
            pages.rewind(seq, to)
            del model.pages[seq][pages_for(to, P):]
            pos[seq] = to
        elif verb == "rm" and live:
            seq = int(rng.choice(sorted(live)))
            pages.release(seq)
            live.discard(seq)
            del model.pages[seq]
            pos[seq] = 0
        check_consistent(pages)
        # the physical pages partition the held entries exactly as the model's tokens do
        token_of = {}
        for seq in live:
            held = flat.table[seq, :flat.held[seq]].tolist()
            assert len(held) == len(model.pages[seq]) == pages_for(int(pos[seq]), P)
            for page, token in zip(held, model.pages[seq]):
                assert token_of.setdefault(page, token) == token
        assert len(set(token_of.values())) == len(token_of)
        shared += int((flat.refs[1:] > 1).sum())
    assert copied >= 5 and shared > 100, (copied, shared)
