"""Hypothesis stateful test of a cache with a state layer (contract §17): every verb that
moves a sequence (`seq_new`, `seq_rm`, `seq_clone`, `rewind`, steps of several
sequences and spans, padded, committed or aborted after the ops ran, prefix
registrations and matches), legal and illegal, against the contract's model of
sequences: each sequence is the inputs it wrote at each position, a rewind truncates
it, a clone copies its first `upto`, a prefix match copies the registered sequence's
first `L`. After every step each real token's conv and delta-rule outputs (and, on
the ssd machine's cache, the ssd's) must equal the float64 oracle's over the
sequence's whole history (tests/stateref.py); every refusal must raise the predicted
error and change nothing a later step can see.
"""
import hashlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvnumba as kv
import test_state_layers as layers
import test_state_ssd as ssd_layers


class StateMachine(RuleBasedStateMachine):
    #: the cache's layers, the model of its sequences and a committed step
    layers = layers

    def __init__(self):
        super().__init__()
        self.cache = kv.BatchedSequenceCache(self.layers.config(state_interval=8))
        self.model = self.layers.Model(11)
        self.hw = {}
        self.keys = {}              # sequence -> its pages' keys
        self.owners = {}            # key -> the inputs of the positions up to its page end
        self.made = 0

    def fresh(self, n):
        """`n` page keys no sequence has used: a sequence's pages past a point where it
        parted from any other (a rewind, a clone, a match) hold inputs of its own."""
        self.made += n
        return [hashlib.blake2b(str(i).encode(), digest_size=32).digest()
                for i in range(self.made - n, self.made)]

    def part(self, seq, position, kept):
        """`seq`'s keys: `kept`'s whole pages below `position`, fresh ones after."""
        whole = position // 8
        self.keys[seq] = kept[:whole] + self.fresh(5 - whole)

    def floor(self, seq):
        hw, m = self.hw[seq], self.cache.config.max_write
        return hw - m if hw > m else 0

    # ------------------------------------------------------------------ verbs
    @precondition(lambda self: len(self.model.seqs) < self.cache.max_seqs)
    @rule()
    def new(self):
        seq = self.cache.seq_new()
        self.model.seqs[seq] = {n: a[:0] for n, a in self.model.inputs(0).items()}
        self.hw[seq] = 0
        self.part(seq, 0, [])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def remove(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model.seqs)))
        self.cache.seq_rm(seq)
        del self.model.seqs[seq], self.hw[seq], self.keys[seq]

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), width_extra=st.integers(0, 2), commit=st.booleans())
    def step(self, data, width_extra, commit):
        seqs = sorted(self.model.seqs)
        ids = data.draw(st.lists(st.sampled_from(seqs), min_size=1, max_size=8))
        counts = {s: ids.count(s) for s in set(ids)}
        m = self.cache.config.max_write
        if any(c > m or len(self.model.seqs[s]["x"]) + c > self.cache.config.capacity
               for s, c in counts.items()):
            return
        width = len(ids) + width_extra
        if commit:
            self.layers.run_step(self.cache, self.model, ids, width)
        else:                        # the ops run, then the step is aborted
            self.layers.run_step(self.cache, self.model, ids, width, commit=False)
            self.cache.abort_step()
            for s in counts:         # the model's sequences keep what they had
                self.model.seqs[s] = {n: a[:len(a) - counts[s]]
                                      for n, a in self.model.seqs[s].items()}
        for s, c in counts.items():
            self.hw[s] = max(self.hw[s], len(self.model.seqs[s]["x"]) + (0 if commit else c))

    @precondition(lambda self: any(len(h["x"]) for h in self.model.seqs.values()))
    @rule(data=st.data())
    def rewind_to(self, data):
        seq = data.draw(st.sampled_from([s for s, h in self.model.seqs.items() if len(h["x"])]))
        pos = len(self.model.seqs[seq]["x"])
        target = data.draw(st.integers(0, pos))
        if target < self.floor(seq):
            try:
                self.cache.rewind(seq, target)
            except kv.RingFloorError:
                assert self.cache.pos(seq) == pos
                return
            raise AssertionError("a rewind below the floor was accepted")
        self.cache.rewind(seq, target)
        self.model.seqs[seq] = {n: a[:target] for n, a in self.model.seqs[seq].items()}
        self.part(seq, target, self.keys[seq])

    @precondition(lambda self: len(self.model.seqs) < self.cache.max_seqs and any(
        len(h["x"]) for h in self.model.seqs.values()))
    @rule(data=st.data())
    def clone(self, data):
        src = data.draw(st.sampled_from([s for s, h in self.model.seqs.items() if len(h["x"])]))
        pos = len(self.model.seqs[src]["x"])
        upto = data.draw(st.integers(max(1, self.floor(src)), pos))
        dst = self.cache.seq_clone(src, upto)
        self.model.seqs[dst] = {n: a[:upto] for n, a in self.model.seqs[src].items()}
        self.hw[dst] = self.hw[src]
        self.part(dst, upto, self.keys[src])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def register(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model.seqs)))
        hist = self.model.seqs[seq]
        for depth, key in enumerate(self.keys[seq][:len(hist["x"]) // 8]):
            self.owners.setdefault(key, {n: a[:(depth + 1) * 8] for n, a in hist.items()})
        matched = self.cache.prefix_register(seq, self.keys[seq])
        assert matched == self.cache.prefix_match(self.keys[seq])

    @precondition(lambda self: len(self.model.seqs) < self.cache.max_seqs and self.model.seqs)
    @rule(data=st.data())
    def from_prefix(self, data):
        """A match starts a sequence holding the inputs registered under its last key
        (equal keys hold equal inputs: `part`)."""
        keys = self.keys[data.draw(st.sampled_from(sorted(self.model.seqs)))]
        matched = self.cache.prefix_match(keys)
        seq = self.cache.seq_from_prefix(keys)
        end = self.cache.pos(seq)
        assert end == matched * 8
        self.model.seqs[seq] = {n: a[:end] for n, a in self.owners[keys[matched - 1]].items()} \
            if matched else {n: a[:0] for n, a in self.model.inputs(0).items()}
        self.hw[seq] = end + self.cache.config.max_write if matched else 0
        self.part(seq, end, keys)

    @invariant()
    def positions_agree(self):
        for seq, hist in self.model.seqs.items():
            assert self.cache.pos(seq) == len(hist["x"])


class SsdStateMachine(StateMachine):
    """The same verbs on a cache whose recurrent layer runs `ssd` (beside a delta rule
    layer: tests/test_state_ssd.py)."""

    layers = ssd_layers


#: programs under the CI profile (the thorough profile's own count otherwise)
CI_PROGRAMS = 4
TestStateLayers = StateMachine.TestCase
TestStateLayers.settings = settings(
    settings.default, max_examples=settings.default.max_examples
    if settings.default.max_examples > 25 else CI_PROGRAMS)
TestSsdStateLayers = SsdStateMachine.TestCase
TestSsdStateLayers.settings = settings(
    settings.default, max_examples=settings.default.max_examples
    if settings.default.max_examples > 25 else 2)
