"""The data path of a prepared step (contract §8): `write`, `attend` and
`update_and_attend` of one cache, each checked whole before anything launches.

`DataPath` knows the cache's storage, attention paths, stream and device, and works on
the open step it is handed (`step.OpenStep`): the step's width, its bound write and
padding launches and its attention routes were made once in `prepare_step`, so a
layer's call checks its arrays, fills in the defaults and launches.
"""
from __future__ import annotations

import math

import numpy as np

from ..args import as_finite, describe, is_int
from .arrays import Result, check, check_out, device_view, overlap
from ..config import CacheConfig
from ..errors import ShapeError, StepProtocolError
from ..kernels.launch.calling import no_output
from ..kernels.out_scale import scale_out
from ..kernels.sinks import no_sinks
from ..refusals import width_hint

#: the dtypes q, k, v and out may have
IO_DTYPES = ("float16", "float32", "bfloat16")
#: what `update_and_attend` passes on to `attend`
ATTEND_KEYWORDS = frozenset({"out", "scale", "softcap", "lse", "sinks"})
_LSE_DTYPES = _SINK_DTYPES = ("float32",)
_NO_SOFTCAP = np.float32(0.0)


class DataPath:
    """`write` / `attend` of one cache: its `config`, `device`, `stream`, storage (a
    `storage.PageStorage`), attention paths (`routing.Routing`), and per layer what
    a launch needs of it: `(ring rows R or 0, mask code (`CacheConfig.mask_codes`), its
    page group's device page table)`."""

    def __init__(self, config: CacheConfig, device: int, stream, storage, paths,
                 layer_geometry: list):
        self.config, self.device, self.stream = config, device, stream
        self.storage, self.paths, self.layer_geometry = storage, paths, layer_geometry
        # the kernels take scale and softcap as float32: the defaults converted once, per
        # layer (1 / sqrt of its head_dim)
        self._shapes = config.layer_shapes
        self._default_scale = [np.float32(1.0 / math.sqrt(shape.head_dim))
                               for shape in self._shapes]
        self._source = [config.source(layer) for layer in range(config.n_layers)]
        # fp8 storage (contract §3): the write multiplies by each layer's reciprocal
        # scales, attention folds k_scale into its scale and multiplies out by v_scale
        self._k_scale = config.k_scale
        self._v_scale = np.array(config.v_scale, np.float32)
        self._inverse = [(np.float32(1 / k), np.float32(1 / v))
                         for k, v in zip(config.k_scale, config.v_scale)]
        self._scaled = config.is_fp8

    def write(self, step, layer, k, v) -> None:
        """`k` `[width, n_kv_heads, head_dim]`, `v` `[width, n_kv_heads, v_head_dim]` (the
        layer's shape) into `layer` for the prepared `step`; refused for a shared layer."""
        self._launch_write(step, self._write_args(step, layer, k, v), k, v)

    def attend(self, step, layer, q, out, scale, softcap, lse, sinks):
        """Attention of `step`'s queries on `layer`; refused before `layer` is written."""
        args = self._attend_args(step, layer, q, out, scale, softcap, lse, sinks)
        source = self._source[args[0]]
        if not step.written[source]:
            whose = f"layer {source}'s K/V" if source == args[0] else \
                f"layer {source}'s K/V, which shared layer {args[0]} reads"
            raise StepProtocolError(f"attend: the prepared step has not written {whose}; "
                                    f"call write({source}, k, v) or update_and_attend "
                                    f"first")
        return self._launch_attend(step, *args)

    def update_and_attend(self, step, layer, q, k, v, kw: dict):
        """`write` then `attend`, every argument of both checked first."""
        if not ATTEND_KEYWORDS.issuperset(kw):
            raise ShapeError(f"update_and_attend: unexpected keyword arguments "
                             f"{sorted(set(kw) - ATTEND_KEYWORDS)} (allowed: out, scale, "
                             f"softcap, lse, sinks)")
        layer = self._write_args(step, layer, k, v)
        attend_args = self._layer_scale(layer, self._attend_inputs(
            step, layer, q, kw.get("out"), kw.get("scale"), kw.get("softcap"), kw.get("lse"),
            kw.get("sinks"), k=k, v=v))
        self._launch_write(step, layer, k, v)
        return self._launch_attend(step, layer, *attend_args)

    # ------------------------------------------------------------------ checks
    def layer(self, layer, verb: str) -> int:
        """`layer` as an int index in `[0, n_layers)`, or `ShapeError`."""
        n_layers = len(self.layer_geometry)
        if type(layer) is int and 0 <= layer < n_layers and \
                self.layer_geometry[layer] is not None:    # the usual call: nothing to convert
            return layer
        if not is_int(layer):
            raise ShapeError(f"{verb}: layer must be an int index in [0, {n_layers}), got "
                             f"{describe(layer)}")
        if not 0 <= layer < n_layers:
            raise ShapeError(f"{verb}: layer {int(layer)} is outside [0, {n_layers})")
        if self.layer_geometry[layer] is None:
            raise ShapeError(f"{verb}: layer {int(layer)} is a state layer "
                             f"({self.config.kinds[layer].describe()}): it attends not; its "
                             f"data path is conv / delta_rule / ssd")
        return int(layer)

    def _write_args(self, step, layer, k, v) -> int:
        """`layer` as an index, once k and v fit the step and the layer stores K/V."""
        layer = self.layer(layer, "write")
        shapes = step.kv_shapes[layer]
        if shapes is None:
            source = self._source[layer]
            raise ShapeError(f"write: layer {layer} is shared with layer {source} and stores "
                             f"nothing; write layer {source}, then attend({layer}, q) reads "
                             f"its K/V")
        if shapes[1] is None and v is not None:
            raise ShapeError(f"write: layer {layer} is latent: its rows [width, 1, "
                             f"{shapes[0][2]}] come as k and its V is their first values; "
                             f"pass v=None")
        try:
            check("k", k, shapes[0], IO_DTYPES, self.device)
            if shapes[1] is not None:
                check("v", v, shapes[1], IO_DTYPES, self.device)
        except ShapeError as exc:
            raise ShapeError(f"{exc}{width_hint(step, k, k if v is None else v)}") from None
        return layer

    def _attend_args(self, step, layer, q, out, scale, softcap, lse, sinks) -> tuple:
        layer = self.layer(layer, "attend")
        return (layer, *self._layer_scale(layer, self._attend_inputs(
            step, layer, q, out, scale, softcap, lse, sinks)))

    def _layer_scale(self, layer: int, inputs: tuple) -> tuple:
        """`inputs` (`_attend_inputs`) with fp8 storage's `k_scale` folded into the scale
        (K = k_scale * stored), the product held to the range every scale keeps
        (`args.as_finite`), or `ConfigError`."""
        if not self._scaled:
            return inputs
        q, out, scale, softcap, lse, sinks = inputs
        k_scale = self._k_scale[layer]
        folded = as_finite(float(scale) * k_scale, f"attend: scale {float(scale)!r} times "
                                                   f"layer {layer}'s k_scale {k_scale!r}")
        return q, out, np.float32(folded), softcap, lse, sinks

    def _attend_inputs(self, step, layer, q, out, scale, softcap, lse, sinks,
                       **inputs) -> tuple:
        """`(q, out, scale, softcap, lse, sinks)` of `layer` checked, the defaults filled
        in; `inputs`: the other arrays of the call (`k`, `v`), which `out` and `lse` must
        not overlap either."""
        shape = self._check_q(step, layer, q)
        if sinks is not None:
            check("sinks", sinks, shape[1:2], _SINK_DTYPES, self.device)
        if out is not None:
            check_out("out", out, self._out_shape(layer, shape), IO_DTYPES, self.device)
        if lse is not None:
            check_out("lse", lse, shape[:2], _LSE_DTYPES)
        if out is not None or lse is not None:
            _check_apart(dict(out=out, lse=lse), dict(q=q, sinks=sinks, **inputs))
        scale = self._default_scale[layer] if scale is None else \
            as_finite(scale, "attend: scale")
        softcap = _NO_SOFTCAP if softcap is None else as_finite(softcap, "attend: softcap",
                                                                positive=True)
        return q, out, scale, softcap, lse, sinks

    def _check_q(self, step, layer, q) -> tuple:
        """q's shape `[width, n_q_heads, head_dim]` on `layer` (its shape), or `ShapeError`
        (array family and dtype first, then the rank, the heads and the shape)."""
        check("q", q, None, IO_DTYPES, self.device)
        shape = tuple(q.shape)
        if len(shape) != 3:
            raise ShapeError(f"q: expected rank 3 [width, n_q_heads, head_dim], got shape "
                             f"{shape}")
        n_q_heads, (n_kv_heads, head_dim, *_) = shape[1], self._shapes[layer]
        if n_q_heads < 1 or n_q_heads % n_kv_heads:
            raise ShapeError(f"q: n_q_heads={n_q_heads} must be a positive multiple of "
                             f"layer {layer}'s n_kv_heads={n_kv_heads} (query head h reads "
                             f"kv head h // (n_q_heads // n_kv_heads))")
        want = (step.width, n_q_heads, head_dim)
        if shape != want:
            raise ShapeError(f"q: expected shape {want} on layer {layer}, got "
                             f"{shape}{width_hint(step, q)}")
        return shape

    def _out_shape(self, layer: int, q_shape: tuple) -> tuple:
        """`out`'s shape for q of `q_shape` on `layer`: `[width, n_q_heads, v_head_dim]`."""
        return q_shape[:2] + (self._shapes[layer].v_head_dim,)

    # ------------------------------------------------------------------ launches
    def _launch_write(self, step, layer, k, v) -> None:
        storage, stream = self.storage, self.stream
        ring_rows, _, pages = self.layer_geometry[layer]
        writes = step.writes[layer]
        k_store, v_store = storage.k_slots[layer], storage.v_slots[layer]
        k = device_view(k, stream)
        v = k if v is None else device_view(v, stream)     # a latent layer: its rows alone
        k_inv, v_inv = self._inverse[layer]
        if len(writes) == 1:                  # K and V of one width: one launch
            writes[0](k_store, v_store, k, v, ring_rows, pages, k_inv, v_inv)
        else:                                 # each its own launch, moving its run twice
            writes[0](k_store, k_store, k, k, ring_rows, pages, k_inv, k_inv)
            writes[1](v_store, v_store, v, v, ring_rows, pages, v_inv, v_inv)
        step.written[layer] = True

    def _launch_attend(self, step, layer, q, out, scale, softcap, lse, sinks):
        stream = self.stream
        result = Result(q, out, self._out_shape(layer, tuple(q.shape)), stream)
        row_lse = None if lse is None else Result(q, lse, tuple(q.shape[:2]), stream)
        lse_device = no_output() if row_lse is None else row_lse.device
        if step.zero is not None:
            step.zero(result.device, lse_device)
        ring_rows, mask_code, pages = self.layer_geometry[layer]
        self.paths.run(step.routes, layer, device_view(q, stream), self.storage.k_slots[layer],
                       self.storage.v_slots[layer], result.device, lse_device,
                       no_sinks() if sinks is None else device_view(sinks, stream),
                       ring_rows=ring_rows, mask_code=mask_code, pages=pages, scale=scale,
                       softcap=softcap)
        if self._scaled:
            scale_out(result.device, self._v_scale[layer], stream)
        if row_lse is not None:
            row_lse.value()          # a host `lse` is filled from the device
        return result.value()


def _check_apart(outputs: dict, inputs: dict) -> None:
    """Refuse (`ShapeError`) an output (`out`, `lse`) that overlaps another output or an
    input (contract §8): the kernels would read what they write. None: not given."""
    given = [(name, array) for name, array in outputs.items() if array is not None]
    for i, (name, array) in enumerate(given):
        for other, found in [*given[i + 1:], *inputs.items()]:
            if found is not None and overlap(array, found):
                raise ShapeError(f"{name}: its memory overlaps {other}'s; pass an {name} "
                                 f"that shares no memory with q, k, v or the other output")
