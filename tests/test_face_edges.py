"""Edges of the paged face, each refused or accepted as the contract says, and nothing
changed by a refusal (`snapshot`): reads of a free sequence's data, NumPy integers in a
config, a Numba device object, a clone whose second pool cannot grow, outputs that
overlap each other or an input; and the install's names."""
import os
import subprocess
import sys

import numpy as np
import pytest

import kvnumba as kv
from kvnumba.data import storage as storage_module
from numba import cuda
from snapshot import assert_unchanged, fill, run_step, snapshot


def cache(**kw):
    base = dict(layers=[kv.flat(), kv.ring(window=3)], n_kv_heads=1, head_dim=8, capacity=32,
                max_seqs=3, max_write=4, max_step=8, dtype="float32", page_size=8)
    return kv.BatchedSequenceCache(kv.CacheConfig(**{**base, **kw}))


def test_a_free_sequences_data_reads_are_refused_and_its_queries_answer():
    c = cache()
    rng = np.random.default_rng(0)
    a, b = c.seq_new(), c.seq_new()
    run_step(c, [a, a, b], rng)
    c.seq_rm(b)
    before = snapshot(c)
    for read in (lambda: c.page_table(b, 0), lambda: c.page_table(b, 1),
                 lambda: c.sequence_kv(b, 0), lambda: c.paged_kv([a, b])):
        with pytest.raises(kv.FreeSequenceError, match=f"sequence {b} is FREE"):
            read()
    assert_unchanged(before, snapshot(c))
    assert (c.state(b), c.pos(b), c.high_water(b), c.floor(b)) == (kv.SlotState.FREE, 0, 0, 0)
    assert c.page_table(a, 0).size == 1 and c.sequence_kv(a, 0)[0].tolist() == [0, 1]
    single = kv.SequenceCache(kv.CacheConfig(max_seqs=1, head_dim=8))
    control = kv.SequenceBatchControl(single)
    with pytest.raises(kv.FreeSequenceError):
        control.sequence_kv(0, 0)


def test_numpy_integers_in_a_config_are_kept_as_ints():
    config = kv.CacheConfig(layers=[kv.flat()], head_dim=np.int64(8), capacity=np.int32(64),
                            max_seqs=np.int64(2), max_write=np.int16(8), max_step=np.int64(8),
                            page_size=np.int64(16), initial_pages=np.int64(3),
                            max_pages=np.uint32(9))
    assert all(type(getattr(config, name)) is int for name in
               ("head_dim", "capacity", "max_seqs", "max_write", "max_step", "page_size",
                "initial_pages", "max_pages"))
    c = kv.BatchedSequenceCache(config)
    assert c.pool_pages()[0].allocated == 3


def test_a_numba_device_object_names_the_device():
    c = kv.BatchedSequenceCache(kv.CacheConfig(head_dim=8), device=cuda.get_current_device())
    assert c.device == 0


def test_a_clone_whose_ring_pool_cannot_grow_leaves_the_flat_pool_as_it_was(monkeypatch):
    """The clone needs a flat page (its straddling page) and a ring: both pools are full,
    and the ring's growth fails. Nothing grows: the flat pool's storage is the same
    array, every byte and table as before."""
    c = cache(initial_pages=2, max_seqs=2)      # per kind: the scratch page and one more
    rng = np.random.default_rng(1)
    a = c.seq_new()                             # its ring: the ring kind's second page
    run_step(c, [a, a, a], rng)                 # positions 0..2: the flat kind's second page
    before = snapshot(c)
    flat_k = c.layer_data(0)[0]
    real = storage_module.PageStorage._allocate

    def ring_fails(self, kind, n_pages):
        if kind == 1:
            raise MemoryError("simulated out of device memory")
        return real(self, kind, n_pages)

    monkeypatch.setattr(storage_module.PageStorage, "_allocate", ring_fails)
    with pytest.raises(kv.CapacityError, match="ring layers of 6 rows from 2 to 4 pages"):
        c.seq_clone(a, upto=3)
    assert c.layer_data(0)[0] is flat_k
    assert_unchanged(before, snapshot(c))
    monkeypatch.undo()
    b = c.seq_clone(a, upto=3)
    assert c.sequence_kv(b, 0)[1].tobytes() == c.sequence_kv(a, 0)[1].tobytes()


@pytest.mark.parametrize("overlapping", ["lse is a view of out", "out is q", "lse inside k"])
def test_outputs_that_overlap_another_output_or_an_input_are_refused(overlapping):
    c = cache(layers=[kv.flat()], n_kv_heads=1)
    rng = np.random.default_rng(2)
    a = c.seq_new()
    c.declare_step([a, a])
    plan = c.prepare_step()
    q = fill(rng, (plan.width, 2, 8))
    k, v = fill(rng, (plan.width, 1, 8)), fill(rng, (plan.width, 1, 8))
    out = np.zeros((plan.width, 2, 8), np.float32)
    lse = np.zeros((plan.width, 2), np.float32)
    if overlapping == "lse is a view of out":
        lse = out[:, :, 0]
    elif overlapping == "out is q":
        out = q
    else:
        k = np.zeros((plan.width, 2, 8), np.float32)[:, :1]     # k's rows hold lse's bytes
        lse = k.base[:, 1, :2]
    before = snapshot(c)
    with pytest.raises(kv.ShapeError, match="overlaps"):
        c.update_and_attend(0, q, k, v, out=out, lse=lse)
    assert_unchanged(before, snapshot(c))
    c.update_and_attend(0, q, fill(rng, (plan.width, 1, 8)), v, out=np.zeros_like(q),
                        lse=np.zeros((plan.width, 2), np.float32))
    c.commit_step()


def test_the_install_adds_no_generic_top_level_name(tmp_path):
    """From a folder outside the checkout, kvnumba's benchmarks and machines are
    `kvnumba.bench` and `kvnumba.statemachines`; `bench` and `statemachines` are not
    kvnumba's."""
    code = ("import importlib.util, kvnumba.bench, kvnumba.statemachines; "
            "print(importlib.util.find_spec('bench'), importlib.util.find_spec('statemachines'))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["None", "None"]
