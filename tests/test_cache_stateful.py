"""Hypothesis stateful test: every BatchControl verb, legal and illegal, against a model.

The model below is written from the contract (docs/contract.md), not from kvnumba: slot states, pos,
high-water and floors as plain Python, the StepPlan tables rebuilt token by
token, full per-position K/V histories per sequence and layer, and attention
from those histories (tests/oracle.py). Every refusal must raise the predicted
error class and leave states, positions, high-waters, the step and every byte
of storage as they were. Pages are modelled too, as counts: which pages each sequence
holds (shared after a fork, copied on a write into a shared page), how many each pool
has, and the `CapacityError` of a step, a fork or a `seq_new` the small fixed pools
cannot serve.
"""
from collections import Counter

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvnumba as kv
from oracle import dense_attention, floor, ring_rows

WINDOWS = [None, 3]          # one flat layer, one ring layer
MAX_SEQS, MAX_WRITE, MAX_STEP, CAPACITY = 3, 3, 8, 48
HEADS, Q_HEADS, DIM = 1, 2, 4
#: a small pool bound: 8 positions a page; the flat pool's 9 pages (one scratch) hold 64
#: positions over all sequences (each may reach 48)
PAGE, FLAT_PAGES = 8, 9
RING_PAGES = FLAT_PAGES     # max_pages bounds every pool: three rings always fit
LIVE = ("claimed", "committed", "rewound")
#: steps, spans and refusals the search ran (printed at the end of the pytest run)
COUNTS = Counter()


class Refused(Exception):
    """The model's prediction that a call must fail, with the error class expected."""

    def __init__(self, cls):
        super().__init__(cls.__name__)
        self.cls = cls


class Model:
    """contract §5-§7 by hand. `hist[seq][layer]` maps position -> (k, v) last written there."""

    def __init__(self):
        self.state = ["free"] * MAX_SEQS
        self.pos = [0] * MAX_SEQS
        self.hw = [0] * MAX_SEQS
        self.hist = [[{} for _ in WINDOWS] for _ in range(MAX_SEQS)]
        # flat pages: each sequence's list of page names, and how many hold each name
        self.pages = [[] for _ in range(MAX_SEQS)]
        self.holders = Counter()
        self.names = iter(range(10**9))
        self.rings = 0

    def flat_free(self):
        return FLAT_PAGES - 1 - len(self.holders)

    def hold(self, s, keep):
        """Sequence `s` keeps its first `keep` flat pages; a page nobody holds goes back."""
        for name in self.pages[s][keep:]:
            self.holders[name] -= 1
            if not self.holders[name]:
                del self.holders[name]
        del self.pages[s][keep:]

    def take(self):
        name = next(self.names)
        self.holders[name] = 1
        return name

    def floor(self, s):
        return floor(self.hw[s], WINDOWS, MAX_WRITE, CAPACITY)

    def seq_new(self):
        free = [s for s in range(MAX_SEQS) if self.state[s] == "free"]
        if not free:
            raise Refused(kv.CacheFullError)
        s = free[0]
        if self.rings == RING_PAGES - 1:
            raise Refused(kv.CapacityError)
        self.rings += 1
        self.state[s], self.pos[s], self.hw[s] = "claimed", 0, 0
        self.hist[s] = [{} for _ in WINDOWS]
        return s

    def _live(self, s, allowed):
        if not 0 <= s < MAX_SEQS:
            raise Refused(kv.UnknownSequenceError)
        if self.state[s] not in allowed:
            raise Refused(kv.SlotStateError)

    def seq_rm(self, s):
        self._live(s, LIVE)
        self.hold(s, 0)
        self.rings -= 1
        self.state[s], self.pos[s], self.hw[s] = "free", 0, 0

    def rewind(self, s, position):
        self._live(s, ("committed", "rewound"))
        if position > self.pos[s] or position < 0:
            raise Refused(kv.PositionError)
        if position < self.floor(s):
            raise Refused(kv.RingFloorError)
        self.hold(s, -(-position // PAGE))
        self.state[s], self.pos[s] = "rewound", position

    def seq_clone(self, s, upto):
        self._live(s, ("committed", "rewound"))
        keep = self.pos[s] if upto is None else upto
        if not 1 <= keep <= self.pos[s]:
            raise Refused(kv.PositionError)
        if keep < self.floor(s):
            raise Refused(kv.RingFloorError)
        free = [d for d in range(MAX_SEQS) if self.state[d] == "free"]
        if not free:
            raise Refused(kv.CacheFullError)
        d = free[0]
        straddles = keep % PAGE != 0
        if straddles > self.flat_free() or self.rings == RING_PAGES - 1:
            raise Refused(kv.CapacityError)
        self.rings += 1
        self.pages[d] = self.pages[s][:keep // PAGE]
        self.holders.update(self.pages[d])
        if straddles:
            self.pages[d].append(self.take())
        self.state[d], self.pos[d], self.hw[d] = "committed", keep, self.hw[s]
        self.hist[d] = [{p: kv_ for p, kv_ in h.items() if p < keep} for h in self.hist[s]]
        return d

    def declare(self, ids, blocks):
        """Segments [(seq, q_start, q_len, pos_start, block)] or Refused, rules in contract order.

        Each maximal run of one id is a span; a sequence's spans take consecutive
        positions in token order.
        """
        if any(not 0 <= s < MAX_SEQS for s in ids):
            raise Refused(kv.UnknownSequenceError)
        if any(self.state[s] == "free" for s in ids):
            raise Refused(kv.SlotStateError)
        runs = []
        for i, s in enumerate(ids):
            if runs and runs[-1][0] == s:
                runs[-1][2] += 1
            else:
                runs.append([s, i, 1])
        if any(sum(r[0] == b for r in runs) != 1 for b in blocks):
            raise Refused(kv.OwnerRunError)
        totals = Counter(ids)
        if any(n > MAX_WRITE for n in totals.values()):
            raise Refused(kv.CapacityError)
        if any(self.pos[s] + n > CAPACITY for s, n in totals.items()):
            raise Refused(kv.CapacityError)
        if len(ids) > MAX_STEP:
            raise Refused(kv.CapacityError)
        if self.new_pages(totals) > self.flat_free():
            raise Refused(kv.CapacityError)
        cursor = {s: self.pos[s] for s in totals}
        segments = []
        for s, q0, n in runs:
            segments.append((s, q0, n, cursor[s], s in blocks))
            cursor[s] += n
        return segments

    def new_pages(self, totals, take=False):
        """Flat pages a step of `totals` (tokens by sequence) takes: pages its positions
        reach, and a copy of a page a sequence writes into while another holds it (each
        sequence in turn, by id). With `take`, the pages change hands."""
        holders = Counter(self.holders)
        needed = 0
        for s in sorted(totals):
            start = self.pos[s]
            if start % PAGE and holders[self.pages[s][start // PAGE]] > 1:
                needed += 1
                holders[self.pages[s][start // PAGE]] -= 1
                if take:
                    self.holders[self.pages[s][start // PAGE]] -= 1
                    self.pages[s][start // PAGE] = self.take()
            reach = -(-(start + totals[s]) // PAGE)
            needed += max(0, reach - len(self.pages[s]))
            if take:
                self.pages[s] += [self.take() for _ in range(reach - len(self.pages[s]))]
        return needed

    def prepare(self, segments):
        totals = Counter()
        for s, _, n, _, _ in segments:
            totals[s] += n
        self.new_pages(totals, take=True)

    def abort_prepared(self, segments):
        for s, *_ in segments:
            self.hold(s, -(-self.pos[s] // PAGE))

    def advance(self, segments, commit):
        """Commit (pos and hw to each sequence's end) or a prepared abort (hw only)."""
        for s, _, n, p0, _ in segments:
            if commit:
                self.pos[s] = p0 + n
                self.state[s] = "committed"
            self.hw[s] = max(self.hw[s], p0 + n)


def snapshot(cache):
    """Everything a refusal must leave untouched."""
    slots = [(cache.state(s), cache.pos(s), cache.high_water(s)) for s in range(MAX_SEQS)]
    data = [tuple(a.copy_to_host() for a in cache.layer_data(i)) for i in range(len(WINDOWS))]
    tables = [cache.page_table(s, layer).tolist() for s in range(MAX_SEQS)
              if cache.state(s) != kv.SlotState.FREE for layer in range(len(WINDOWS))]
    return slots, cache.step_state, data, tables, cache.pool_pages()


def assert_unchanged(before, after):
    assert before[0] == after[0] and before[1] == after[1]
    for (k0, v0), (k1, v1) in zip(before[2], after[2]):
        assert k0.shape == k1.shape
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)


#: what every step rule draws besides its ids: padding, a verb tried mid-step, the ending
STEP_ARGS = dict(data=st.data(), pad=st.integers(0, 3),
                 meddle=st.sampled_from([None, None, None, "seq_new", "rewind", "declare"]),
                 ending=st.sampled_from(["commit", "commit", "commit", "abort_declared",
                                         "abort_prepared", "abort_written"]))


def live_at_least(n):
    """A rule that needs at least `n` live sequences."""
    return precondition(lambda self: sum(state != "free" for state in self.model.state) >= n)


class CacheMachine(RuleBasedStateMachine):
    @initialize(n_live=st.integers(0, MAX_SEQS))
    def setup(self, n_live):
        self.config = kv.CacheConfig(
            layers=[kv.flat() if w is None else kv.ring(window=w) for w in WINDOWS],
            n_kv_heads=HEADS, head_dim=DIM, capacity=CAPACITY, max_seqs=MAX_SEQS,
            max_write=MAX_WRITE, max_step=MAX_STEP, dtype="float32", page_size=PAGE,
            initial_pages=4, max_pages=FLAT_PAGES)
        self.cache = kv.BatchedSequenceCache(self.config)
        self.model = Model()
        self.rng = np.random.default_rng(0)
        for _ in range(n_live):
            self.seq_new()

    def call(self, predict, act):
        """Run `predict` on the model; the cache's `act` must agree (result or error class)."""
        try:
            expected = predict()
        except Refused as refusal:
            before = snapshot(self.cache)
            try:
                act()
            except refusal.cls:
                assert_unchanged(before, snapshot(self.cache))
                return None
            raise AssertionError(f"expected {refusal.cls.__name__}")
        got = act()
        assert got == expected
        return got

    # ---------------------------------------------------------------- sequence verbs
    @rule()
    def seq_new(self):
        self.call(self.model.seq_new, self.cache.seq_new)

    @rule(seq=st.integers(-1, MAX_SEQS))
    def seq_rm(self, seq):
        self.call(lambda: self.model.seq_rm(seq), lambda: self.cache.seq_rm(seq))

    @rule(seq=st.integers(-1, MAX_SEQS), back=st.integers(-1, 8))
    def rewind(self, seq, back):
        target = (self.model.pos[seq] if 0 <= seq < MAX_SEQS else 0) - back
        self.call(lambda: self.model.rewind(seq, target), lambda: self.cache.rewind(seq, target))

    @rule(seq=st.integers(0, MAX_SEQS - 1), back=st.none() | st.integers(-1, 8))
    def seq_clone(self, seq, back):
        upto = None if back is None else self.model.pos[seq] - back
        self.call(lambda: self.model.seq_clone(seq, upto),
                  lambda: self.cache.seq_clone(seq, upto))

    @rule(verb=st.sampled_from(["prepare_step", "commit_step", "abort_step"]))
    def step_verb_while_idle(self, verb):
        def refused():
            raise Refused(kv.StepProtocolError)
        self.call(refused, getattr(self.cache, verb))

    # ---------------------------------------------------------------- one step
    @rule(**STEP_ARGS)
    @live_at_least(1)
    def step(self, data, pad, meddle, ending):
        """One run per sequence: mostly steps the cache accepts, now and then any ids."""
        if data.draw(st.integers(0, 9), label="legal ids") > 0:
            runs = self.live_runs(data)
        else:
            runs = data.draw(st.lists(st.tuples(st.integers(-1, MAX_SEQS), st.integers(1, 4)),
                                      min_size=1, max_size=4), label="runs")
        self.run_step(data, runs, pad, meddle, ending)

    @rule(data=st.data(), seq=st.integers(0, MAX_SEQS - 1), steps=st.integers(2, 4))
    def fill_pages(self, data, seq, steps):
        """A few full steps of one sequence, so that forks share whole pages and rewinds
        land in them (then copy-on-write), and the pool's bound is reached."""
        for _ in range(steps):
            if self.model.state[seq] == "free":
                return
            self.run_step(data, [(seq, MAX_WRITE)], 0, None, "commit")

    @rule(**STEP_ARGS)
    @live_at_least(2)  # one sequence's spans alone would merge back into one run
    def step_in_spans(self, data, pad, meddle, ending):
        """Each sequence's tokens cut into spans, the spans of all sequences interleaved."""
        runs = self.interleave(data, self.live_runs(data, at_least=2))
        self.run_step(data, runs, pad, meddle, ending)

    def live_runs(self, data, at_least=1):
        """(seq, n) runs of distinct live sequences; now and then one run over max_write."""
        live = [s for s in range(MAX_SEQS) if self.model.state[s] != "free"]
        runs = data.draw(st.lists(st.tuples(st.sampled_from(live), st.integers(1, MAX_WRITE)),
                                  min_size=at_least, max_size=len(live),
                                  unique_by=lambda r: r[0]),
                         label="runs")
        if data.draw(st.integers(0, 9), label="stretch") == 0:
            runs[0] = (runs[0][0], runs[0][1] + data.draw(st.integers(1, MAX_STEP)))
        return runs

    def run_step(self, data, runs, pad, meddle, ending):
        """Declare the runs' ids, then end the step as `ending` says, checking every stage."""
        # draft-block owners mostly among the step's sequences (so spans meet blocks),
        # now and then any slot (so "no run" and "several runs" are refused too)
        owners = data.draw(st.sampled_from(["none", "none", "in step", "any"]), label="owners")
        in_step = sorted({s for s, _ in runs if 0 <= s < MAX_SEQS})
        pool = in_step if owners == "in step" and in_step else range(MAX_SEQS)
        block_pick = data.draw(st.lists(st.sampled_from(pool), max_size=2),
                               label="blocks") if owners != "none" else []
        ids = [s for s, n in runs for _ in range(n)]
        blocks = sorted(set(block_pick))
        try:
            segments = self.model.declare(ids, blocks)
        except Refused as refusal:
            before = snapshot(self.cache)
            COUNTS[f"declare refused: {refusal.cls.__name__}"] += 1
            try:
                self.cache.declare_step(np.array(ids), blocks=blocks)
            except refusal.cls:
                assert_unchanged(before, snapshot(self.cache))
                return
            raise AssertionError(f"declare_step({ids}, blocks={blocks}): expected "
                                 f"{refusal.cls.__name__}")
        plan = self.cache.declare_step(ids, blocks=blocks)
        COUNTS[f"declared, then {ending}"] += 1
        self.check_declared(plan, segments, len(ids))
        if meddle:  # sequence verbs and a second declare are refused while a step is open
            before = snapshot(self.cache)
            act = {"seq_new": self.cache.seq_new, "rewind": lambda: self.cache.rewind(ids[0], 0),
                   "declare": lambda: self.cache.declare_step([ids[0]])}[meddle]
            try:
                act()
                raise AssertionError(f"{meddle} inside an open step was not refused")
            except kv.StepProtocolError:
                assert_unchanged(before, snapshot(self.cache))
        if ending == "abort_declared":
            self.cache.abort_step()
            return
        width = len(ids) + pad
        if width > MAX_STEP:
            before = snapshot(self.cache)
            try:
                self.cache.prepare_step(width)
                raise AssertionError("width above max_step was not refused")
            except kv.CapacityError:
                assert_unchanged(before, snapshot(self.cache))
            width = MAX_STEP
        plan = self.cache.prepare_step(width)
        self.model.prepare(segments)
        self.check_prepared(plan, segments, width)
        if ending == "abort_prepared":
            self.cache.abort_step()
            self.model.abort_prepared(segments)
            self.model.advance(segments, commit=False)
            return
        self.write_and_attend(plan, segments, width)
        if ending == "abort_written":
            self.cache.abort_step()
            self.model.abort_prepared(segments)
            self.model.advance(segments, commit=False)
            return
        self.cache.commit_step()
        COUNTS["steps committed"] += 1
        if len(segments) > len({g[0] for g in segments}):
            COUNTS["committed steps with a sequence in several spans"] += 1
        self.model.advance(segments, commit=True)

    @staticmethod
    def interleave(data, runs):
        """Cut each (seq, n) run into spans and shuffle them, keeping each sequence's order."""
        pieces = []
        for seq, n in runs:
            cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=2),
                                    label="cuts")) if n > 1 else []
            bounds = [0] + cuts + [n]
            pieces.append([(seq, b - a) for a, b in zip(bounds, bounds[1:])])
        order = data.draw(st.permutations([i for i, p in enumerate(pieces) for _ in p]),
                          label="interleaving")
        taken = [0] * len(pieces)
        spans = []
        for i in order:
            spans.append(pieces[i][taken[i]])
            taken[i] += 1
        return spans

    def check_declared(self, plan, segments, n_tokens):
        assert plan.n_tokens == n_tokens and plan.width is None
        assert self.cache.step_state == kv.StepState.DECLARED
        expect = [[q0, n, s, p0, int(b)] for s, q0, n, p0, b in segments]
        np.testing.assert_array_equal(plan.seq_info[:, :5], expect)
        np.testing.assert_array_equal(plan.logit_indices, [q0 + n - 1 for _, q0, n, _, _ in
                                                           segments])
        assert [(g.seq, g.q_start, g.q_len, g.pos_start, g.block) for g in plan.segments] == \
            [tuple(x) for x in segments]
        for s, *_ in segments:
            assert self.cache.state(s) == kv.SlotState.PREFILLING

    def check_prepared(self, plan, segments, width):
        cols, positions = [], []
        for s, _, n, p0, _ in segments:
            cols += [s] * n
            positions += list(range(p0, p0 + n))
        pad = width - len(cols)
        np.testing.assert_array_equal(plan.seq_cols, cols + [MAX_SEQS] * pad)
        np.testing.assert_array_equal(plan.positions, positions + [0] * pad)
        assert plan.width == width and self.cache.step_state == kv.StepState.PREPARED
        assert not plan.seq_cols.flags.writeable

    def write_and_attend(self, plan, segments, width):
        scale = 1 / np.sqrt(DIM)
        for layer, window in enumerate(WINDOWS):
            k = self.rng.standard_normal((width, HEADS, DIM)).astype(np.float32)
            v = self.rng.standard_normal((width, HEADS, DIM)).astype(np.float32)
            q = self.rng.standard_normal((width, Q_HEADS, DIM)).astype(np.float32)
            out = np.full((width, Q_HEADS, DIM), np.nan, np.float32)
            for s, q0, n, p0, _ in segments:
                for i in range(n):
                    self.model.hist[s][layer][p0 + i] = (k[q0 + i], v[q0 + i])
            self.cache.update_and_attend(layer, q, k, v, out=out)
            for s, q0, n, p0, block in segments:
                hist = self.model.hist[s][layer]
                end = p0 + n
                lo = 0 if window is None else max(0, p0 - window + 1)
                keys = np.zeros((end, HEADS, DIM))
                values = np.zeros((end, HEADS, DIM))
                for j in range(lo, end):
                    keys[j], values[j] = hist[j]
                want = dense_attention(q[q0:q0 + n], keys, values, p0, window, block, scale)
                np.testing.assert_allclose(out[q0:q0 + n], want, rtol=1e-4, atol=1e-5)
            assert not np.any(out[plan.n_tokens:]), "padding rows must be zero"

    # ---------------------------------------------------------------- invariants
    @invariant()
    def slots_match_the_model(self):
        COUNTS["invariant checks"] += 1
        assert self.cache.step_state == kv.StepState.IDLE
        for s in range(MAX_SEQS):
            assert self.cache.state(s).name.lower() == self.model.state[s], s
            assert self.cache.pos(s) == self.model.pos[s], s
            assert self.cache.high_water(s) == self.model.hw[s], s
            assert self.cache.floor(s) == self.model.floor(s), s

    @invariant()
    def pages_match_the_model(self):
        """Each sequence holds the model's flat pages, shared exactly where the model's are,
        and the pool counts them once."""
        flat = self.cache.pool_pages()[0]
        assert flat.in_use == 1 + len(self.model.holders)
        tables = [self.cache.page_table(s, 0).tolist()
                  if self.cache.state(s) != kv.SlotState.FREE else [] for s in range(MAX_SEQS)]
        names = {}
        for s in range(MAX_SEQS):
            assert len(tables[s]) == len(self.model.pages[s]), s
            for page, name in zip(tables[s], self.model.pages[s]):
                assert names.setdefault(name, page) == page, (s, name)
        assert len(set(names.values())) == len(names)
        if any(self.model.holders[n] > 1 for n in self.model.holders):
            COUNTS["states with a shared page"] += 1

    @invariant()
    def storage_matches_the_histories(self):
        """Every live sequence's K/V read back equals its history; a free one's data
        reads are refused."""
        for s in range(MAX_SEQS):
            if self.cache.state(s) == kv.SlotState.FREE:
                with pytest.raises(kv.FreeSequenceError):
                    self.cache.sequence_kv(s, 0)
                continue
            for layer, window in enumerate(WINDOWS):
                positions, k, v = self.cache.sequence_kv(s, layer)
                pos, hw = self.model.pos[s], self.model.hw[s]
                start = 0 if window is None else max(0, hw - ring_rows(window, MAX_WRITE,
                                                                      CAPACITY))
                np.testing.assert_array_equal(positions, np.arange(start, pos))
                hist = self.model.hist[s][layer]
                for i, p in enumerate(positions):
                    np.testing.assert_array_equal(k[i], hist[p][0])
                    np.testing.assert_array_equal(v[i], hist[p][1])


TestCacheMachine = CacheMachine.TestCase
# more programs than the suite-wide CI profile: this machine is where most bugs would show
TestCacheMachine.settings = settings(settings.default,
                                     max_examples=max(30, settings.default.max_examples))
