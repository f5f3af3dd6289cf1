"""Everything a refusal must leave as it was, as comparable bytes.

`snapshot(face)` covers a `BatchedSequenceCache`, a `SequenceCache`, a
`SequenceBatchControl` or a `SessionTable` (with its control): every slot's state,
pos, high-water and floor; the step state; the open plan's tables; which layers
the step has written; the staged device tables; and the raw bytes of every
layer's K and V storage (compared as bytes: never-written storage may hold NaN).
`fill` and `run_step` give a face the history the refusals are tried against.
"""
import numpy as np

import kvnumba as kv


def _cache(face):
    """The `BatchedSequenceCache` underneath any face."""
    if isinstance(face, kv.SessionTable):
        face = face.control
    return getattr(face, "_inner", face)


def _plan(plan):
    if plan is None:
        return None
    arrays = (plan.seq_info, plan.logit_indices, plan.seq_cols, plan.positions)
    return (plan.n_tokens, plan.width) + tuple(None if a is None else a.tobytes()
                                                for a in arrays)


def _pages(cache):
    """Every kind's host tables, holdings, reference counts and free stack, the device
    tables and the patches waiting for the next upload."""
    pages, storage = cache._pool.accounting, cache._pool.storage
    kinds = [(k.table.tobytes(), k.held.tobytes(), k.refs.tobytes(), k.n_free,
              k.free[:k.n_free].tobytes()) for k in pages.groups]
    return [kinds, storage.device_tables.copy_to_host().tobytes(),
            sorted(pages.pending.items())]


def snapshot(face):
    cache = _cache(face)
    slots = [(cache.state(s), cache.pos(s), cache.high_water(s), cache.floor(s))
             for s in range(cache.max_seqs)]
    storage = []
    for layer in range(cache.config.n_layers):
        k, v = cache.layer_data(layer)
        storage.append((k.shape, k.copy_to_host().tobytes(), v.copy_to_host().tobytes()))
    step = cache._steps.step
    written = None if step is None or step.written is None else step.written.tobytes()
    state = (slots, cache.step_state, _plan(cache.plan), written,
             cache._steps.upload.device.copy_to_host().tobytes(), storage + _pages(cache),
             cache.nbytes)
    if isinstance(face, kv.SessionTable):
        sessions = [(sid, face.seq(sid)) for sid in face.sessions]
        state += (sessions, face._next_sid)
    return state


def assert_unchanged(before, after):
    """Compare two snapshots, naming the first part that differs."""
    names = ("slots", "step_state", "plan", "written layers", "staged tables", "storage or page tables",
             "nbytes", "sessions", "next session id")
    for name, a, b in zip(names, before, after):
        assert a == b, f"a refused call changed the {name}"
    assert len(before) == len(after)


def fill(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def run_step(control, ids, rng, width=None, commit=True, write_layers=None):
    """Declare `ids`, prepare at `width`, write random K/V into `write_layers` (default:
    every layer) and commit (or leave the step prepared)."""
    control.declare_step(ids)
    plan = control.prepare_step(width)
    shape = (plan.width, control.config.n_kv_heads, control.config.head_dim)
    layers = range(control.config.n_layers) if write_layers is None else write_layers
    for layer in layers:
        control.write(layer, fill(rng, shape), fill(rng, shape))
    if commit:
        control.commit_step()
