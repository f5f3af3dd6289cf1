"""Hypothesis stateful test: every BatchControl verb, legal and illegal, against a model.

The model below is written from the contract (docs/contract.md), not from kvnumba: slot states, pos,
high-water and floors as plain Python (the ring layer a sliding window, or chunked in
machines of their own), the StepPlan tables rebuilt token by
token, full per-position K/V histories per sequence and layer, and attention
from those histories (tests/oracle.py). Every refusal must raise the predicted
error class and leave states, positions, high-waters, the step and every byte
of storage as they were. Pages are modelled too, as counts: which pages each sequence
holds (shared after a fork, copied on a write into a shared page), how many each pool
has, and the `CapacityError` of a step, a fork or a `seq_new` the small fixed pools
cannot serve.

The prefix index (contract §14) is modelled too: every written token has an id (each
sequence follows one of a few token scripts, and may switch scripts when it rewinds),
K and V are a function of (token, position, layer), and the model keeps the index's
nodes (key -> depth, last use, flat page), their reference on the flat pages, their
ring pages, and the eviction order (least recently used first, deepest first among
equally recent; pages held by a sequence never). A sequence started from a match must
read back exactly the K/V of the tokens it matched, and attend as if it had written
them; the host page accounting (reference counts, owners, free stacks) must agree with
the tables and the index after every rule.

The search runs once per storage, float32 and each 8-bit float format (per-layer
scales): at fp8 the model holds what the storage should (the float32 input quantised by the
independent reference of tests/fp8ref.py, times the layer's scale), and every check of
attention, stored K/V and the index's pages is against those values.
"""
import hashlib
from collections import Counter

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvnumba as kv
from fp8ref import FORMATS, quantised
from oracle import dense_attention, floor, ring_rows

#: one flat layer and one ring layer of reach 3: a sliding window of 3, or (a machine's
#: `chunked`) chunks of 3 (contract §15), stored in rings of the same rows
RING = 3
N_LAYERS = 2
MAX_SEQS, MAX_WRITE, MAX_STEP, CAPACITY = 3, 3, 8, 48
HEADS, Q_HEADS, DIM = 1, 2, 4
#: a small pool bound: 8 positions a page; the flat pool's 9 pages (one scratch) hold 64
#: positions over all sequences (each may reach 48)
PAGE, FLAT_PAGES = 8, 9
#: (initial_pages, max_pages) of every pool, drawn per program: the growing pool above,
#: or a small fixed pool where the index's cached pages are evicted often (ring pages
#: too: with 5 pages, three rings leave the index one). max_pages bounds every pool:
#: three rings always fit.
POOLS = [(4, FLAT_PAGES), (6, 6), (5, 5)]
LIVE = ("claimed", "committed", "rewound")
RING_ROWS = ring_rows(RING, MAX_WRITE, CAPACITY)
#: positions of each page of positions a node keeps on the ring layer: the last W - 1
#: (what a match at the page's end reads back; C - 1 for chunks: a chunk's first query
#: reads as far back as a window's)
KEPT = min(PAGE, RING - 1)
#: token ids: each sequence writes the tokens of one script at their positions (script 1
#: agrees with script 0 for 12 positions, mid-page); K and V of a token at a position on
#: a layer are fixed (`KV`), so equal tokens mean equal bytes wherever they came from
VOCAB, N_SCRIPTS = 50, 3
_rng = np.random.default_rng(14)
SCRIPTS = _rng.integers(0, VOCAB, (N_SCRIPTS, CAPACITY))
SCRIPTS[1, :12] = SCRIPTS[0, :12]
KV = _rng.standard_normal((N_LAYERS, VOCAB, CAPACITY, 2, HEADS, DIM)).astype(np.float32)
#: a program's storage: dtype -> (k_scale, v_scale), one per layer. The fp8 scales are
#: chosen so that the inputs (standard normal) meet every kind of rounding: a scale whose
#: float32 reciprocal is inexact (0.3), subnormals (e4m3 below 2**-6: |k| < 0.125 at scale
#: 8, ~10% of values; e5m2 below 2**-14: |k| < 0.061 at scale 1000, ~5%) and saturation
#: (|v| > 2.24 at 1/200 past e4m3's 448, ~3%; |v| > 1.72 at 3e-5 past e5m2's 57344, ~10%)
STORAGE = {"float32": ((1.0, 1.0), (1.0, 1.0)),
           "float8_e4m3": ((0.3, 8.0), (1.0, 1 / 200)),
           "float8_e5m2": ((1000.0, 0.3), (3e-5, 1.0))}
#: per storage, the NumPy type of a stored element
ELEMENT = {"float32": np.dtype(np.float32),
           **{dtype: np.dtype(FORMATS[dtype]) for dtype in STORAGE if dtype != "float32"}}
#: per storage, what it holds for KV (float64: the layer's scale times the stored value)
STORED = {}
for _dtype, (_k_scale, _v_scale) in STORAGE.items():
    STORED[_dtype] = KV.astype(np.float64)
    if _dtype != "float32":
        for _layer in range(N_LAYERS):
            STORED[_dtype][_layer, ..., 0, :, :] = quantised(KV[_layer, ..., 0, :, :], _dtype,
                                                             _k_scale[_layer])
            STORED[_dtype][_layer, ..., 1, :, :] = quantised(KV[_layer, ..., 1, :, :], _dtype,
                                                             _v_scale[_layer])
#: bytes of K and V of one page of one layer
PAGE_BYTES = {dtype: 2 * PAGE * HEADS * DIM * ELEMENT[dtype].itemsize for dtype in STORAGE}
EXTRAS = [b"", b"tenant"]
#: steps, spans and refusals the search ran (printed at the end of the pytest run)
COUNTS = Counter()


def page_keys(tokens, extra):
    """The keys of `tokens`' whole pages (contract §14, written out again): page i's key is
    BLAKE2b-256(key of page i - 1 (32 zero bytes for page 0) || len(extra) as 8 bytes LE ||
    extra || the page's tokens as int64 LE)."""
    parent, salt, keys = bytes(32), len(extra).to_bytes(8, "little") + extra, []
    for i in range(len(tokens) // PAGE):
        page = np.asarray(tokens[i * PAGE:(i + 1) * PAGE], "<i8").tobytes()
        parent = hashlib.blake2b(parent + salt + page, digest_size=32).digest()
        keys.append(parent)
    return keys


class Refused(Exception):
    """The model's prediction that a call must fail, with the error class expected."""

    def __init__(self, cls):
        super().__init__(cls.__name__)
        self.cls = cls


class Model:
    """contract §5-§7 and §14 by hand. `tokens[seq]` maps position -> the token last written
    there (its K/V as written: `given`; as stored, for a storage `storage`: `kv`)."""

    def __init__(self, max_pages, storage, chunked):
        self.max_pages = max_pages
        self.storage = storage
        self.chunked = chunked            # layer 1 chunked (else a sliding window)
        self.stored = STORED[storage]
        self.state = ["free"] * MAX_SEQS
        self.pos = [0] * MAX_SEQS
        self.hw = [0] * MAX_SEQS
        self.tokens = [{} for _ in range(MAX_SEQS)]
        self.script = [0] * MAX_SEQS       # the script each sequence writes from
        # flat pages: each sequence's list of page names, and how many hold each name
        self.pages = [[] for _ in range(MAX_SEQS)]
        self.holders = Counter()
        self.names = iter(range(10**9))
        self.rings = 0
        # the prefix index: key -> [depth, last use, flat page name, the page's tokens], in
        # insertion order (the order the index lists its nodes in, which breaks ties of
        # use and depth); each node also holds one ring page of its own
        self.nodes = {}
        self.tick = 0
        self.evicted = 0
        #: token lists registered: (tokens, extra, keys), the latest last
        self.lists = []
        self.seen = Counter()     # what this program did (`note`)

    def note(self, what, n=1):
        """Count `what` in COUNTS, and for the programs that did it at least once."""
        if n:
            COUNTS[what] += n
            self.seen[what] += n

    def given(self, s, layer, p):
        return KV[layer, self.tokens[s][p], p]

    def kv(self, s, layer, p):
        return self.stored[layer, self.tokens[s][p], p]

    def read(self, layer, k, v):
        """What storage arrays `k`, `v` (the storage's elements, or their bytes) hold, as
        the values `kv` gives: each element times its layer's scale, in float64."""
        k_scale, v_scale = (np.float32(scales[layer]) for scales in STORAGE[self.storage])
        element = ELEMENT[self.storage]
        return (np.asarray(k).view(element).astype(np.float64) * k_scale,
                np.asarray(v).view(element).astype(np.float64) * v_scale)

    def committed(self, s):
        return [self.tokens[s][p] for p in range(self.pos[s])]

    def flat_free(self):
        """Flat pages a step can still take: free, by growth, or evicted from the index."""
        return self.max_pages - 1 - len(self.holders)

    def ring_free(self):
        return self.max_pages - 1 - self.rings

    def indexed_names(self):
        return {node[2] for node in self.nodes.values()}

    def cached(self):
        """Pages only the index holds: (flat, ring)."""
        return sum(not self.holders[node[2]] for node in self.nodes.values()), len(self.nodes)

    def hold(self, s, keep):
        """Sequence `s` keeps its first `keep` flat pages; a page nobody holds goes back
        (to the index, when it owns it)."""
        for name in self.pages[s][keep:]:
            self.let_go(name)
        del self.pages[s][keep:]

    def let_go(self, name):
        self.holders[name] -= 1
        if not self.holders[name]:
            del self.holders[name]

    def take(self):
        name = next(self.names)
        self.holders[name] = 1
        return name

    def floor(self, s):
        if self.chunked:
            return floor(self.hw[s], [], MAX_WRITE, CAPACITY, chunks=[RING])
        return floor(self.hw[s], [None, RING], MAX_WRITE, CAPACITY)

    def mask(self, layer):
        """`(window, chunk)` of `layer` as the oracle takes them."""
        if layer == 0:
            return None, None
        return (None, RING) if self.chunked else (RING, None)

    # ------------------------------------------------------------ the index's pages
    def reserve(self, kind, needed, protect=()):
        """Pages of `kind` ("flat" or "ring") a verb takes: free ones first (the pool grows
        to max_pages), then cached ones, evicting nodes least recently used first, the
        deepest of equally recent first, never one of `protect` nor one whose page of
        the kind a sequence holds."""
        cached_flat, cached_ring = self.cached()
        used = 1 + (len(self.holders) + cached_flat if kind == "flat" else
                    self.rings + cached_ring)
        count = needed - (self.max_pages - used)
        if count <= 0:
            return
        victims = [key for key, node in self.nodes.items() if key not in protect
                   and (kind == "ring" or not self.holders[node[2]])]
        victims.sort(key=lambda key: (self.nodes[key][1], -self.nodes[key][0]))
        assert len(victims) >= count, "the model let a verb take pages nobody can give"
        if len(victims) > count:
            self.note("evictions choosing among nodes")
        for key in victims[:count]:
            del self.nodes[key]
        self.evicted += count
        self.note(f"nodes evicted for {kind} pages", count)

    def use(self, keys, new=()):
        """One use of the nodes of `keys` (all nodes of one call share it), the last
        `len(new)` of them new nodes (each a `(depth, flat page name, tokens)`)."""
        if keys:
            self.tick += 1
        for key, (depth, name, tokens) in zip(keys[len(keys) - len(new):], new):
            self.nodes[key] = [depth, 0, name, tokens]
        for key in keys:
            self.nodes[key][1] = self.tick

    def match(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.nodes:
            n += 1
        return n

    # ------------------------------------------------------------ sequence verbs
    def seq_new(self, script=0):
        free = [s for s in range(MAX_SEQS) if self.state[s] == "free"]
        if not free:
            raise Refused(kv.CacheFullError)
        s = free[0]
        if self.ring_free() < 1:
            raise Refused(kv.CapacityError)
        self.reserve("ring", 1)
        self.rings += 1
        self.state[s], self.pos[s], self.hw[s] = "claimed", 0, 0
        self.tokens[s], self.script[s] = {}, script
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
        if straddles > self.flat_free() or self.ring_free() < 1:
            raise Refused(kv.CapacityError)
        self.reserve("flat", straddles)
        self.reserve("ring", 1)
        self.rings += 1
        self.pages[d] = self.pages[s][:keep // PAGE]
        self.holders.update(self.pages[d])
        if straddles:
            self.pages[d].append(self.take())
        self.state[d], self.pos[d], self.hw[d] = "committed", keep, self.hw[s]
        self.tokens[d] = {p: t for p, t in self.tokens[s].items() if p < keep}
        self.script[d] = self.script[s]
        return d

    # ------------------------------------------------------------ prefix verbs
    def register(self, s, keys):
        """Index `s`'s committed whole pages under `keys`: the leading keys indexed after.
        Walking the keys: an indexed one is used again; a new one is indexed while the
        ring still holds the rows a match at its end reads back, while no node owns its
        flat page, and while the ring pool can give the new node a page without
        evicting the chain's own nodes."""
        if not 0 <= s < MAX_SEQS:
            raise Refused(kv.UnknownSequenceError)
        if self.state[s] == "free":
            raise Refused(kv.FreeSequenceError)
        keys = keys[:self.pos[s] // PAGE]
        oldest = max(0, self.hw[s] - RING_ROWS)      # the ring holds [oldest, pos)
        owned = self.indexed_names()
        chain, new = [], []
        for d, key in enumerate(keys):
            if key in self.nodes:
                chain.append(key)
            elif (d + 1) * PAGE - KEPT < oldest or self.pages[s][d] in owned:
                self.note("register stopped: ring rows gone" if (d + 1) * PAGE - KEPT < oldest
                          else "register stopped: flat page indexed under another key")
                break
            else:
                new.append(d)
        room = max(0, self.ring_free() - len(chain))
        if len(new) > room:
            self.note("register stopped: no ring page left")
            new = new[:room]
        self.reserve("ring", len(new), protect=chain)
        self.use(chain + [keys[d] for d in new],
                 [(d, self.pages[s][d], [self.tokens[s][p] for p in range(d * PAGE, (d + 1) * PAGE)])
                  for d in new])
        self.note("nodes registered", len(new))
        return self.match(keys)

    def seq_from_prefix(self, keys, tokens, script):
        """Start a sequence from the longest indexed prefix of `keys` (of `tokens`)."""
        m = self.match(keys)
        if m == 0:
            return self.seq_new(script)
        free = [s for s in range(MAX_SEQS) if self.state[s] == "free"]
        if not free:
            raise Refused(kv.CacheFullError)
        s = free[0]
        chain = keys[:m]
        while chain and self.ring_free() - len(chain) < 1:
            chain = chain[:-1]     # the rings take the last node's ring page
        if self.ring_free() - len(chain) < 1:
            raise Refused(kv.CapacityError)
        self.reserve("ring", 1, protect=chain)
        self.rings += 1
        self.use(chain)
        self.pages[s] = [self.nodes[key][2] for key in chain]
        self.holders.update(self.pages[s])
        end = len(chain) * PAGE
        self.state[s] = "committed" if chain else "claimed"
        self.pos[s], self.hw[s] = end, end + MAX_WRITE if chain else 0
        self.tokens[s] = {p: tokens[p] for p in range(end)}
        self.script[s] = script
        self.note("seq_from_prefix: " + ("hit" if len(chain) == m else
                                         "hit, shortened" if chain else "shortened to nothing"))
        return s

    def forget(self, keys):
        gone = [key for key in keys if key in self.nodes]
        for key in gone:
            del self.nodes[key]
        return len(gone)

    def clear(self):
        return self.forget(list(self.nodes))

    # ------------------------------------------------------------ steps
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
        reach, and a copy of a page a sequence writes into while another sequence or the
        index holds it (each sequence in turn, by id). With `take`, the pages change
        hands."""
        refs = Counter(self.holders)
        refs.update(self.indexed_names())
        needed = 0
        for s in sorted(totals):
            start = self.pos[s]
            name = self.pages[s][start // PAGE] if start % PAGE else None
            if name is not None and refs[name] > 1:
                needed += 1
                refs[name] -= 1
                if take:
                    self.note("copy-on-write of " + ("an indexed page" if name in
                                                     self.indexed_names() else "a shared page"))
                    self.let_go(name)
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
        self.reserve("flat", self.new_pages(totals))
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
    """Everything a refusal must leave untouched: slots, the step, every byte, the page
    tables, the pools, the index (its keys, counts, and last uses: they decide what is
    evicted next)."""
    slots = [(cache.state(s), cache.pos(s), cache.high_water(s)) for s in range(MAX_SEQS)]
    data = [tuple(a.copy_to_host() for a in cache.layer_data(i)) for i in range(N_LAYERS)]
    tables = [cache.page_table(s, layer).tolist() for s in range(MAX_SEQS)
              if cache.state(s) != kv.SlotState.FREE for layer in range(N_LAYERS)]
    index = cache._pool.index
    uses = sorted((key, int(index.used[node])) for key, node in index.nodes.items())
    return (slots, cache.step_state, data, tables, cache.pool_pages(), cache.prefix_counts,
            uses)


def assert_unchanged(before, after):
    assert before[0] == after[0] and before[1] == after[1]
    for (k0, v0), (k1, v1) in zip(before[2], after[2]):
        assert k0.shape == k1.shape
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
    assert before[3:] == after[3:]


#: what every step rule draws besides its ids: padding, a verb tried mid-step, the ending
STEP_ARGS = dict(data=st.data(), pad=st.integers(0, 3),
                 meddle=st.sampled_from([None, None, None, "seq_new", "rewind", "declare",
                                         "prefix"]),
                 ending=st.sampled_from(["commit", "commit", "commit", "abort_declared",
                                         "abort_prepared", "abort_written"]))


def live_at_least(n):
    """A rule that needs at least `n` live sequences."""
    return precondition(lambda self: sum(state != "free" for state in self.model.state) >= n)


class CacheMachine(RuleBasedStateMachine):
    #: how this machine's caches store K/V (a key of STORAGE)
    storage = "float32"
    #: whether its ring layer is chunked (else a sliding window)
    chunked = False

    @initialize(n_live=st.integers(0, MAX_SEQS), pool=st.sampled_from(POOLS),
                register=st.sampled_from([EXTRAS[0], EXTRAS[0], EXTRAS[1]]))
    def setup(self, n_live, pool, register):
        """A cache with pools `pool`, K/V stored as `storage` and `n_live` sequences; every
        step's sequences register their pages (under the extra key `register`) after its
        commit."""
        storage = self.storage
        initial, most = pool
        self.register = register
        scales = {} if storage == "float32" else dict(zip(("k_scale", "v_scale"),
                                                          STORAGE[storage]))
        self.config = kv.CacheConfig(
            layers=[kv.flat(), kv.chunked(RING) if self.chunked else kv.ring(window=RING)],
            n_kv_heads=HEADS, head_dim=DIM, capacity=CAPACITY, max_seqs=MAX_SEQS,
            max_write=MAX_WRITE, max_step=MAX_STEP, dtype=storage, page_size=PAGE,
            initial_pages=initial, max_pages=most, **scales)
        self.cache = kv.BatchedSequenceCache(self.config)
        self.model = Model(most, storage, self.chunked)
        self.model.seen[f"{storage} storage"] += 1
        self.model.seen["chunked layers" if self.chunked else "sliding-window layers"] += 1
        self.rng = np.random.default_rng(0)
        self.page_of = {}        # flat page name -> the page id it was first seen at
        self.meddled = 0
        for s in range(n_live):
            self.seq_new(s % N_SCRIPTS)

    def teardown(self):
        seen = self.model.seen
        for what in seen:
            COUNTS[f"programs with {what}"] += 1

    def call(self, predict, act):
        """Run `predict` on the model; the cache's `act` must agree (result or error class).
        Returns the result, or `Refused` after a refusal."""
        try:
            expected = predict()
        except Refused as refusal:
            before = snapshot(self.cache)
            try:
                act()
            except refusal.cls:
                assert_unchanged(before, snapshot(self.cache))
                return Refused
            raise AssertionError(f"expected {refusal.cls.__name__}")
        got = act()
        assert got == expected
        return got

    # ---------------------------------------------------------------- sequence verbs
    @rule(script=st.integers(0, N_SCRIPTS - 1))
    def seq_new(self, script):
        self.call(lambda: self.model.seq_new(script), self.cache.seq_new)

    @rule(seq=st.integers(-1, MAX_SEQS))
    def seq_rm(self, seq):
        self.call(lambda: self.model.seq_rm(seq), lambda: self.cache.seq_rm(seq))

    @rule(seq=st.integers(-1, MAX_SEQS), back=st.integers(-1, 8),
          script=st.none() | st.integers(0, N_SCRIPTS - 1))
    def rewind(self, seq, back, script):
        """Back `back` positions; then on with another script's tokens when `script` says
        (what it writes over differs from what it registered)."""
        target = (self.model.pos[seq] if 0 <= seq < MAX_SEQS else 0) - back
        if self.call(lambda: self.model.rewind(seq, target),
                     lambda: self.cache.rewind(seq, target)) is not Refused and \
                script is not None:
            self.model.script[seq] = script

    @rule(seq=st.integers(0, MAX_SEQS - 1), back=st.none() | st.integers(-1, 8))
    def seq_clone(self, seq, back):
        upto = None if back is None else self.model.pos[seq] - back
        self.call(lambda: self.model.seq_clone(seq, upto),
                  lambda: self.cache.seq_clone(seq, upto))

    # ---------------------------------------------------------------- prefix index
    @rule(seq=st.integers(-1, MAX_SEQS), extra=st.sampled_from(EXTRAS))
    def register_pages(self, seq, extra):
        """Register a sequence's pages whenever (late: its ring may have lost their rows)."""
        self.prefix_register(seq, extra)

    def prefix_register(self, seq, extra):
        """Register `seq`'s tokens (every one the model knows: those past `pos` must be
        left out) under `extra`; remember the committed list when pages are indexed."""
        model = self.model
        known = [model.tokens[seq][p] for p in range(len(model.tokens[seq]))] \
            if 0 <= seq < MAX_SEQS else []
        got = self.call(lambda: model.register(seq, page_keys(known, extra)),
                        lambda: self.cache.prefix_register(seq, page_keys(known, extra)))
        if got not in (Refused, 0):
            tokens = tuple(model.committed(seq))
            model.lists = [e for e in model.lists if e[:2] != (tokens, extra)][-5:] + \
                [(tokens, extra, page_keys(tokens, extra))]
            model.note("registrations indexing pages")

    def token_lists(self):
        """What a request's prompt may start with: each script's tokens (what sequences
        write unless they switched scripts), and each registered list."""
        return [(tuple(SCRIPTS[i].tolist()), EXTRAS[0], None) for i in range(N_SCRIPTS)] + \
            self.model.lists

    @rule(data=st.data(), steps=st.integers(0, 2))
    def seq_from_prefix(self, data, steps):
        """A sequence started from a token list (`token_lists`: mostly a registered one),
        mostly whole, else cut back, then a page of some script's tokens (the list's own
        continuation or a diverging tail), under the list's extra key or (now and then)
        the other one: it shares what the index holds of it. Then `steps` full steps of
        it, as a server computes the rest of a prompt (registered after each commit).
        When every slot is taken, mostly one is freed first."""
        if "free" not in self.model.state and data.draw(st.integers(0, 3), label="room") > 0:
            self.seq_rm(data.draw(st.integers(0, MAX_SEQS - 1), label="removed"))
        lists = self.model.lists if self.model.lists and data.draw(
            st.integers(0, 3), label="registered") else self.token_lists()
        tokens, extra, _ = data.draw(st.sampled_from(lists), label="list")
        back = data.draw(st.sampled_from([0, 0, 0, 1, 4, 8, 12, 24]), label="back")
        cut = max(0, len(tokens) - back)
        script = data.draw(st.integers(0, N_SCRIPTS - 1), label="script")
        if data.draw(st.integers(0, 3), label="other extra") == 0:
            extra = EXTRAS[1 - EXTRAS.index(extra)]
        tokens = list(tokens[:cut]) + SCRIPTS[script, cut:cut + PAGE].tolist()
        keys = page_keys(tokens, extra)
        assert self.cache.prefix_match(keys) == self.model.match(keys)
        seq = self.call(lambda: self.model.seq_from_prefix(keys, tokens, script),
                        lambda: self.cache.seq_from_prefix(keys))
        for i in range(steps if seq is not Refused else 0):   # the first attends: it reads
            self.run_step(data, [(seq, MAX_WRITE)], 0, None, "commit", attend=i == 0)  # the hit

    @rule(data=st.data())
    @precondition(lambda self: self.model.nodes)
    def prefix_forget(self, data):
        """Forget a run of a token list's keys, or (now and then) every key."""
        if data.draw(st.integers(0, 7), label="clear") == 0:
            self.call(self.model.clear, self.cache.prefix_clear)
            return
        tokens, extra, _ = data.draw(st.sampled_from(self.token_lists()), label="list")
        keys = page_keys(tokens, extra)
        start = data.draw(st.integers(0, len(keys)), label="start")
        stop = data.draw(st.integers(start, len(keys)), label="stop")
        self.call(lambda: self.model.forget(keys[start:stop]),
                  lambda: self.cache.prefix_forget(keys[start:stop]))

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

    def run_step(self, data, runs, pad, meddle, ending, attend=True):
        """Declare the runs' ids, then end the step as `ending` says, checking every stage
        (the attention too unless `attend` is false: K/V written only)."""
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
        if meddle:  # sequence verbs, prefix verbs and a second declare are refused while
            before = snapshot(self.cache)               # a step is open
            if meddle == "prefix":
                self.meddled += 1
                meddle = ["prefix_register", "seq_from_prefix", "prefix_forget",
                          "prefix_clear"][self.meddled % 4]
            keys = page_keys(SCRIPTS[0], b"")
            act = {"seq_new": self.cache.seq_new, "rewind": lambda: self.cache.rewind(ids[0], 0),
                   "declare": lambda: self.cache.declare_step([ids[0]]),
                   "prefix_register": lambda: self.cache.prefix_register(ids[0], keys),
                   "seq_from_prefix": lambda: self.cache.seq_from_prefix(keys),
                   "prefix_forget": lambda: self.cache.prefix_forget(keys),
                   "prefix_clear": self.cache.prefix_clear}[meddle]
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
        self.write_and_attend(plan, segments, width, attend)
        if ending == "abort_written":
            self.cache.abort_step()
            self.model.abort_prepared(segments)
            self.model.advance(segments, commit=False)
            return
        self.cache.commit_step()
        COUNTS["steps committed"] += 1
        if self.model.storage != "float32":
            COUNTS["steps committed over fp8 storage"] += 1
        if len(segments) > len({g[0] for g in segments}):
            COUNTS["committed steps with a sequence in several spans"] += 1
        self.model.advance(segments, commit=True)
        for s in sorted({g[0] for g in segments}):   # while the rings hold their rows
            self.prefix_register(s, self.register)

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

    def write_and_attend(self, plan, segments, width, attend=True):
        """Each sequence writes its script's tokens at their positions (padding random
        K/V); with `attend`, every layer's attention against the model's histories."""
        scale = 1 / np.sqrt(DIM)
        model = self.model
        for s, q0, n, p0, _ in segments:
            for p in range(p0, p0 + n):
                model.tokens[s][p] = int(SCRIPTS[model.script[s], p])
        for layer in range(N_LAYERS):
            window, chunk = model.mask(layer)
            k = self.rng.standard_normal((width, HEADS, DIM)).astype(np.float32)
            v = self.rng.standard_normal((width, HEADS, DIM)).astype(np.float32)
            q = self.rng.standard_normal((width, Q_HEADS, DIM)).astype(np.float32)
            out = np.full((width, Q_HEADS, DIM), np.nan, np.float32)
            for s, q0, n, p0, _ in segments:
                for i in range(n):
                    k[q0 + i], v[q0 + i] = model.given(s, layer, p0 + i)
            if not attend:
                self.cache.write(layer, k, v)
                continue
            self.cache.update_and_attend(layer, q, k, v, out=out)
            for s, q0, n, p0, block in segments:
                end = p0 + n
                lo = 0 if window is None else max(0, p0 - window + 1)
                if chunk:
                    lo = p0 - p0 % chunk
                keys = np.zeros((end, HEADS, DIM))
                values = np.zeros((end, HEADS, DIM))
                for j in range(lo, end):
                    keys[j], values[j] = model.kv(s, layer, j)
                want = dense_attention(q[q0:q0 + n], keys, values, p0, window, block, scale,
                                       chunk=chunk)
                # float32 arithmetic over K/V of the inputs' magnitude, whatever the storage:
                # fp8 adds two float32 roundings (the softmax scale times k_scale, the output
                # times v_scale), a few 1e-8 relative
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
        """Each sequence and each index node holds the model's flat pages, shared exactly
        where the model's are, and the pools count them once: held by sequences, cached
        (the index's alone) or free, `in_use + free + cached == max_pages`."""
        model = self.model
        flat, ring = self.cache.pool_pages()
        cached_flat, cached_ring = model.cached()
        assert (flat.in_use, flat.cached) == (1 + len(model.holders), cached_flat)
        assert (ring.in_use, ring.cached) == (1 + model.rings, cached_ring)
        for pool in (flat, ring):
            assert pool.in_use + pool.free + pool.cached == pool.max_pages == model.max_pages
        assert self.cache.prefix_counts == (len(model.nodes), model.evicted,
                                            (cached_flat + cached_ring) *
                                            PAGE_BYTES[model.storage])
        index = self.cache._pool.index
        assert set(index.nodes) == set(model.nodes)
        tables = [self.cache.page_table(s, 0).tolist()
                  if self.cache.state(s) != kv.SlotState.FREE else [] for s in range(MAX_SEQS)]
        seen = []
        for s in range(MAX_SEQS):
            assert len(tables[s]) == len(model.pages[s]), s
            seen += zip(model.pages[s], tables[s])
        seen += [(node[2], int(index.node_pages[index.nodes[key], 0]))
                 for key, node in model.nodes.items()]
        # a page name keeps its page while anyone holds it; the pages of live names differ
        alive = set(model.holders) | model.indexed_names()
        self.page_of = {name: page for name, page in self.page_of.items() if name in alive}
        for name, page in seen:
            assert self.page_of.setdefault(name, page) == page, name
        assert len(set(self.page_of.values())) == len(self.page_of)
        if any(model.holders[n] > 1 for n in model.holders):
            COUNTS["states with a shared page"] += 1
        if cached_flat:
            model.note("states with cached flat pages")

    @invariant()
    def page_accounting_is_consistent(self):
        """Per pool, from the host tables alone: a page's reference count is the number of
        live sequences' entries naming it, plus one when an index node owns it (plus one
        for the scratch page); the free stack holds exactly the unreferenced pages, each
        once and unowned (so no free page is in a table or a node); every node owns one
        page of each pool, and nothing else is owned. Every registered list matches as
        far as the model says."""
        pages, index = self.cache._pool.accounting, self.cache._pool.index
        nodes = np.array(list(index.nodes.values()), np.int64)
        for i, kind in enumerate(pages.groups):
            refs = np.zeros(kind.n_pages, np.int64)
            refs[0] = 1
            for s in range(MAX_SEQS):
                held = kind.table[s, :kind.held[s]]
                assert held.size == 0 or self.model.state[s] != "free", s
                np.add.at(refs, held, 1)
            owned = kind.owner >= 0
            refs += owned
            np.testing.assert_array_equal(kind.refs, refs)
            free = kind.free[:kind.n_free]
            assert sorted(free.tolist()) == np.flatnonzero(refs == 0).tolist()
            assert (kind.owner[free] == -1).all()
            node_pages = index.node_pages[nodes, i]
            assert (node_pages >= 0).all()
            np.testing.assert_array_equal(kind.owner[node_pages], nodes)
            assert np.count_nonzero(owned) == nodes.size
        for _, _, keys in self.model.lists:
            assert self.cache.prefix_match(keys) == self.model.match(keys)

    @invariant()
    def the_index_holds_what_was_registered(self):
        """Every node's pages hold the K/V of its page's tokens, whoever else holds them:
        the flat page all of it, the ring page (by absolute position) the rows a match at
        the page's end reads back."""
        index = self.cache._pool.index
        if not self.model.nodes:
            return
        for layer in range(N_LAYERS):
            k, v = self.model.read(layer, *(a.copy_to_host()
                                            for a in self.cache.layer_data(layer)))
            rows = range(PAGE) if layer == 0 else range(PAGE - KEPT, PAGE)
            for key, (depth, _, _, tokens) in self.model.nodes.items():
                page = index.node_pages[index.nodes[key], layer]   # kind i is layer i here
                for row in rows:
                    want_k, want_v = self.model.stored[layer, tokens[row], depth * PAGE + row]
                    np.testing.assert_array_equal(k[page, row], want_k)
                    np.testing.assert_array_equal(v[page, row], want_v)

    @invariant()
    def storage_matches_the_histories(self):
        """Every live sequence's K/V read back (times the scales) equals its history, as
        stored (for a sequence started from a match: the K/V of the tokens it matched); a
        free one's data reads are refused."""
        for s in range(MAX_SEQS):
            if self.cache.state(s) == kv.SlotState.FREE:
                with pytest.raises(kv.FreeSequenceError):
                    self.cache.sequence_kv(s, 0)
                continue
            for layer in range(N_LAYERS):
                positions, k, v = self.cache.sequence_kv(s, layer)
                k, v = self.model.read(layer, k, v)
                pos, hw = self.model.pos[s], self.model.hw[s]
                start = 0 if layer == 0 else max(0, hw - RING_ROWS)
                np.testing.assert_array_equal(positions, np.arange(start, pos))
                for i, p in enumerate(positions):
                    want_k, want_v = self.model.kv(s, layer, p)
                    np.testing.assert_array_equal(k[i], want_k)
                    np.testing.assert_array_equal(v[i], want_v)


def machine_test(storage, ci_programs, chunked=False):
    """The search over caches storing K/V as `storage`, their ring layer chunked or a
    sliding window: `ci_programs` programs under the CI profile, the profile's own count
    under the thorough one."""
    machine = type(f"CacheMachine_{storage}{'_chunked' if chunked else ''}", (CacheMachine,),
                   {"storage": storage, "chunked": chunked})
    test = machine.TestCase
    test.settings = settings(settings.default,
                             max_examples=max(ci_programs, settings.default.max_examples
                                              if settings.default.max_examples > 25
                                              else ci_programs))
    return test


# under the CI profile, 12 programs (each of many steps, the prefix index's included) keep
# the suite within its time: one machine per storage and ring kind (a drawn storage would
# leave the split to chance, and hypothesis draws its first choice most often)
TestCacheMachine = machine_test("float32", 3)
TestCacheMachineChunked = machine_test("float32", 3, chunked=True)
TestCacheMachineE4M3 = machine_test("float8_e4m3", 3)
TestCacheMachineE5M2Chunked = machine_test("float8_e5m2", 3, chunked=True)
