"""The step protocol of one cache (contract §7): `declare`, `prepare`, `commit`, `abort`
over the cache's parts, and the one holder of the open step (`step`, the cache's record;
`plan`, its read-only view) and of the last step's K/V write launches.

Host planning (`host.declarer`) stays apart from device work: `prepare` takes the step's
pages (`Pool.claim_step`), writes every table its launches read into one upload, sends it
in one copy, applies the step's page work (`Pool.apply`) and binds the launches. The
cache's public verbs (`BatchedSequenceCache.declare_step` ...) carry the documentation.
"""
from __future__ import annotations

import numpy as np

from ..args import as_ids, as_int
from ..data.upload import Sections
from ..errors import ShapeError
from ..arith.positions import SEQ_INFO_FIELDS, ring_floor, stage_tables
from ..arith.state_runs import RUN_COL, RUN_FIELDS, state_runs
from ..host.slots import StepMachine, StepState
from ..host.step import OpenStep, StepPlan
from ..kernels import padding
from ..kernels.moves import write
from ..kernels.state import chunked, conv, recurrence
from ..refusals import half_written_refusal, unprepared_refusal, unrun_state_refusal, \
    width_refusal


class StepProtocol:
    """The step verbs over the cache's `slots` (`SlotTable`), `pool`, `declarer`, step
    `upload` and attention `routing`; padding tokens go to sequence column `pad_col`;
    launches on `stream`. `machine`: the step machine; `step` / `plan`: the open step
    and its view, None between steps."""

    def __init__(self, *, config, slots, pool, declarer, upload, routing, pad_col: int,
                 stream):
        self.config, self.slots, self.pool, self.declarer = config, slots, pool, declarer
        self.upload, self.routing, self.pad_col, self.stream = upload, routing, pad_col, stream
        self.machine = StepMachine()
        self.step: OpenStep | None = None
        self.plan: StepPlan | None = None
        # per layer the elements a token's K and V take (a shared layer: none; a latent
        # layer its rows only, written as K and as V alike) and the storing layers (the
        # ones a commit needs written)
        self._runs = [None if not spec.stores else
                      (shape.n_kv_heads * shape.head_dim,) * 2 if shape.v_in_k else
                      (shape.n_kv_heads * shape.head_dim, shape.n_kv_heads * shape.v_head_dim)
                      for spec, shape in zip(config.layers, config.layer_shapes)]
        self._storing = np.array([spec.stores for spec in config.layers])
        # what each step starts from, worked out once: the layers counted as written
        # before any write (the shared ones; `OpenStep.prepare` copies it), and whether
        # every layer stores (then a commit checks `written` whole, without a mask)
        self._unwritten = ~self._storing
        self._all_store = bool(self._storing.all())
        # per layer and state part (conv, recurrent) whether a step starts with it run:
        # every part but the state layers' own
        self._unran = np.ones((config.n_layers, 2), bool)
        for layer in config.state_layers:
            kind = config.kinds[layer]
            self._unran[layer] = kind.conv is None, kind.recurrent is None
        self._states = bool(config.state_layers)
        self._state_rows = min(config.capacity, config.max_write)
        self._writes = {}     # the last prepared step's K/V writes (`write.WriteRun`) by run
        #: what the last prepared step's layers took: its width and tables, and per layer
        #: its writes (`_layer_writes`) and the shapes of its K and V (`_kv_shapes`)
        self._made = (None, None, (), None)

    def declare(self, seq_ids, blocks) -> StepPlan:
        next_state = self.machine.check("declare", "declare_step")
        ids = as_ids(seq_ids, self.config.max_seqs, "declare_step seq_ids")
        if ids.size == 0:
            raise ShapeError("declare_step: seq_ids must be a non-empty 1-D sequence of ints "
                             "(one sequence id per token)")
        step = self.declarer.declare(ids, self.declarer.block_ids(blocks))
        self.machine.apply("declare", next_state)
        self.step, self.plan = step, StepPlan(step)
        return self.plan

    def prepare(self, width) -> StepPlan:
        next_state = self.machine.check("prepare", "prepare_step")
        step, config, pool = self.step, self.config, self.pool
        width = step.n_tokens if width is None else as_int(width, "prepare_step width")
        if not step.n_tokens <= width <= config.max_step:
            raise width_refusal(width, step.n_tokens, config)
        work = pool.claim_step(step.seqs, step.totals, self.slots.pos, step.pages_needed,
                               "prepare_step")
        upload, info = self.upload, step.seq_info
        host = upload.begin(2 * width + info.size)
        end = stage_tables(host, *step.spans, info, step.n_tokens, width, self.pad_col)
        tokens = host[:2 * width].copy()
        tokens.setflags(write=False)
        upload.mark(Sections.TOKENS, 2 * width)
        upload.mark(Sections.SEGMENTS, int(end))
        routes = self.routing.route(info, step.max_q_len, step.max_kv_len, upload)
        if self._states:
            n_runs, n_chunked = self._stage_state_plan(info, upload)
        if work is not pool.accounting.no_work:
            pool.stage(upload, work)
        self.routing.bind(routes, upload)
        upload.send()
        if work is not pool.accounting.no_work:
            pool.apply(upload, work)
        made = self._made
        if made[0] != width or made[1] is not upload.device:    # else a steady loop's step
            made = self._made = (width, upload.device, self._layer_writes(width, upload.device),
                                 self._kv_shapes(width))
        step.prepare(width, self.pad_col, tokens, upload, routes, made[2],     # by position,
                     padding.prepare(width, step.n_tokens, self.stream),   # `OpenStep.prepare`'s
                     made[3], self._unwritten,                             # order
                     (pool.storage, upload, self.routing.workspace))
        if self._states:
            step.ran = self._unran.copy()
            device, section = upload.device, upload.section
            runs, order, segments = (device[at.offset:at.offset + at.size] for at in (
                section(Sections.STATE_RUNS), section(Sections.STATE_ORDER),
                section(Sections.SEGMENTS)))
            padded = step.n_tokens if step.n_tokens < width else None
            step.state_plan = (
                conv.prepare(device[:2 * width], width, step.n_tokens, self.stream),
                recurrence.prepare(runs.reshape(n_runs, RUN_FIELDS), order,
                                   segments.reshape(-1, SEQ_INFO_FIELDS), n_runs,
                                   self.config.max_write, self.stream, n_tokens=padded,
                                   n_chunked=n_chunked, chunk=chunked.CHUNK))
        self.machine.apply("prepare", next_state)
        return self.plan

    def commit(self) -> None:
        next_state = self.machine.check("commit", "commit_step")
        step = self.step
        written = step.written if self._all_store else step.written[self._storing]
        if 0 < np.count_nonzero(written) < written.size:
            raise half_written_refusal(step.written, self._storing)
        if self._states and (written.any() or step.ran[~self._unran].any()):
            if not step.ran.all():
                raise unrun_state_refusal(step.ran, self._unran)
            if not written.all():
                raise half_written_refusal(step.written, self._storing)
        self.slots.advance("commit", step.seqs, step.totals)
        self._close(next_state, "commit")

    def abort(self) -> None:
        next_state = self.machine.check("abort", "abort_step")
        step, slots = self.step, self.slots
        seqs = step.seqs
        slots.apply("abort", seqs, slots.check("abort", seqs))
        if step.prepared:
            hw = slots.high_water
            hw[seqs] = np.maximum(hw[seqs], slots.pos[seqs] + step.totals)
            self.pool.accounting.abort(seqs, slots.pos)
        self._close(next_state, "abort")

    def _stage_state_plan(self, info: np.ndarray, upload) -> int:
        """Put the step's recurrence plan (`arith.state_runs`, each sequence's floor as
        the state layers see it) into `upload`, and move the pool's mirror of each
        sequence's base position as the kernels will (`Pool.state_base`: to 0 at
        position 0, to the floor once it is more than `max_write` past it); returns its
        runs and how many of them are chunked (the last ones)."""
        m = self.config.max_write
        floors = ring_floor(self.slots.high_water, self._state_rows, m)
        runs, order, n_chunked = state_runs(info, floors, chunked.CHUNK)
        seqs, base = runs[:, RUN_COL], self.pool.state_base
        starts = self.slots.pos[seqs]
        moved = floors[seqs] - base[seqs] > m
        base[seqs] = np.where(starts == 0, 0, np.where(moved, floors[seqs], base[seqs]))
        upload.put(Sections.STATE_RUNS, runs)
        upload.put(Sections.STATE_ORDER, order)
        return len(runs), n_chunked

    def _layer_writes(self, width: int, tables) -> tuple:
        """Per layer the write launches of a step of `width` tokens staged in `tables`
        (`write.WriteRun`s: one for K and V, or K's then V's where their widths differ;
        None for a shared layer)."""
        found = self._writes
        if any(run.width != width or run.tables is not tables for run in found.values()):
            found.clear()
        config = self.config
        for runs in self._runs:
            for run in runs or ():
                if run not in found:
                    found[run] = write.prepare(tables, width, run, config.storage_dtype,
                                               self.pool.accounting.page_bits, self.stream)
        return tuple(
            None if runs is None else
            (found[runs[0]],) if runs[0] == runs[1] else (found[runs[0]], found[runs[1]])
            for runs in self._runs)

    def _kv_shapes(self, width: int) -> list:
        """Per layer the shapes of its K and V inputs in a step of `width` tokens (None for
        a shared layer, V's None for a latent layer; read only: `OpenStep.kv_shapes`)."""
        return [None if runs is None else
                ((width, shape.n_kv_heads, shape.head_dim),
                 None if shape.v_in_k else (width, shape.n_kv_heads, shape.v_head_dim))
                for runs, shape in zip(self._runs, self.config.layer_shapes)]

    def check_declarable(self, seqs: np.ndarray) -> None:
        """What `declare` would raise first for `seqs` (valid ids, int64): an open step,
        then a free or busy sequence. Changes nothing."""
        self.machine.check("declare", "declare_step")
        self.slots.check("declare", seqs)

    def prepared(self, verb: str) -> OpenStep:
        """The open step, once prepared, or `StepProtocolError` naming `verb`."""
        if self.machine.index != StepState.PREPARED:
            raise unprepared_refusal(verb, self.machine.state)
        return self.step

    def _close(self, next_state, event) -> None:
        self.machine.apply(event, next_state)
        self.step = self.plan = None
