"""The data path of a prepared step on state layers (contract §17): `conv`, and
`delta_rule` or `ssd` (a layer's recurrence keeps one op for life), each checked whole
before anything launches.

Each op runs once per layer per step, over the step's token order and segments as for
attention: every segment from its sequence's state, which it advances; padding rows give
zeros. The step's recurrence plan (`arith.state_runs`: one run per sequence, its
segments in token order and its floor) was staged by `prepare_step`; the kernels
(`kernels.state`) know the columns, never the slots.
"""
from __future__ import annotations

import math

import numpy as np

from ..args import as_finite, describe, is_int
from ..config import CacheConfig
from ..errors import ShapeError, StepProtocolError
from ..kernels.state import delta_rule as delta_kernel, ssd as ssd_kernel
from ..refusals import width_hint
from .arrays import Result, check, device_view
from .attend import IO_DTYPES
from .state_storage import Rule

#: an op's parts, as `OpenStep.ran` counts them: the conv window, the recurrent state
CONV, RECURRENT = 0, 1
#: what `conv`'s `activation` may be
ACTIVATIONS = (None, "silu")


class StatePath:
    """`conv` / `delta_rule` / `ssd` of one cache: its `config`, `device`, `stream` and state
    storage (`state_storage.StateStorage`)."""

    def __init__(self, config: CacheConfig, device: int, stream, storage):
        self.config, self.device, self.stream, self.storage = config, device, stream, storage
        self._kinds = config.kinds

    def conv(self, step, layer, x, weight, bias, activation):
        """`y [width, channels]`: the depthwise causal convolution of `x [width,
        channels]` with `weight [channels, conv_width]` over each sequence's own inputs."""
        layer, kind = self._state_layer(step, layer, "conv", CONV)
        channels, width = kind.conv
        check("x", x, None, IO_DTYPES, self.device)
        if tuple(x.shape) != (step.width, channels):
            raise ShapeError(f"conv: x: expected shape {(step.width, channels)} on layer "
                             f"{layer} (conv {channels} channels x {width}), got "
                             f"{tuple(x.shape)}{width_hint(step, x)}")
        check("weight", weight, (channels, width), IO_DTYPES, self.device)
        if bias is not None:
            check("bias", bias, (channels,), IO_DTYPES, self.device)
        if activation not in ACTIVATIONS:
            raise ShapeError(f"conv: activation={describe(activation)}: must be None or "
                             f"'silu'")
        stream = self.stream
        ring = self.storage.layers[layer].window
        result = Result(x, None, (step.width, channels), stream)
        launches = step.state_plan[CONV]
        launches.write(ring, device_view(x, stream))
        launches.apply(ring, device_view(weight, stream),
                       None if bias is None else device_view(bias, stream), result.device,
                       activation == "silu")
        step.ran[layer, CONV] = True
        return result.value()

    def delta_rule(self, step, layer, q, k, v, g, beta, scale, qk_l2norm):
        """`o [width, heads, v_dim]`: the gated delta rule (contract §17) of each sequence's
        tokens from its state, which it advances."""
        layer, kind = self._state_layer(step, layer, "delta_rule", RECURRENT)
        heads, dk, dv = kind.recurrent
        where = f"on layer {layer} (recurrent {heads} heads x {dk} x {dv})"
        for name, array, shape in (("q", q, (step.width, heads, dk)),
                                   ("k", k, (step.width, heads, dk)),
                                   ("v", v, (step.width, heads, dv))):
            _check_rows(step, name, array, shape, where, self.device)
        check("g", g, None, IO_DTYPES, self.device)
        if tuple(g.shape) not in ((step.width, heads), (step.width, heads, dk)):
            raise ShapeError(f"delta_rule: g: expected shape {(step.width, heads)} (a "
                             f"log-decay per head) or {(step.width, heads, dk)} (per key "
                             f"channel) {where}, got {tuple(g.shape)}{width_hint(step, g)}")
        if beta is not None:
            _check_rows(step, "beta", beta, (step.width, heads), where, self.device)
        if not isinstance(qk_l2norm, (bool, np.bool_)):
            raise ShapeError(f"delta_rule: qk_l2norm={describe(qk_l2norm)}: must be True or "
                             f"False")
        scale = np.float32(1.0 / math.sqrt(dk)) if scale is None else \
            np.float32(as_finite(scale, "delta_rule: scale"))
        self._keep_rule(layer, "delta_rule", Rule("delta_rule", len(g.shape) == 3,
                                                   beta is not None))
        stream = self.stream
        view = lambda a: device_view(a, stream)   # noqa: E731
        result = Result(q, None, (step.width, heads, dv), stream)
        delta_kernel.apply(step.state_plan[RECURRENT], *self.storage.layers[layer][1:], view(q),
                           view(k), view(v), view(g), None if beta is None else view(beta),
                           result.device, scale, bool(qk_l2norm))
        step.ran[layer, RECURRENT] = True
        return result.value()

    def ssd(self, step, layer, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit):
        """`y [width, heads, head_dim]`: Mamba2's SSD (contract §17) of each sequence's
        tokens from its state, which it advances."""
        layer, kind = self._state_layer(step, layer, "ssd", RECURRENT)
        heads, head_dim, d_state = kind.recurrent
        where = f"on layer {layer} (recurrent {heads} heads x {head_dim} x {d_state})"
        width = step.width
        for name, array, shape in (("x", x, (width, heads, head_dim)), ("dt", dt, (width, heads))):
            _check_rows(step, name, array, shape, where, self.device, "ssd")
        check("B", B, None, IO_DTYPES, self.device)
        groups = B.shape[1] if len(B.shape) == 3 else 0
        if len(B.shape) != 3 or tuple(B.shape) != (width, groups, d_state) or groups < 1 \
                or heads % groups:
            raise ShapeError(f"ssd: B: expected shape {(width, 'groups', d_state)} with "
                             f"groups dividing the {heads} heads {where}, got "
                             f"{tuple(B.shape)}{width_hint(step, B)}")
        _check_rows(step, "C", C, (width, groups, d_state), where, self.device, "ssd")
        for name, array in (("A", A), ("D", D), ("dt_bias", dt_bias)):
            if array is not None or name == "A":
                check(name, array, None, IO_DTYPES, self.device)
                if tuple(array.shape) != (heads,):
                    raise ShapeError(f"ssd: {name}: expected shape {(heads,)} (one a head) "
                                     f"{where}, got {tuple(array.shape)}")
        if not isinstance(dt_softplus, (bool, np.bool_)):
            raise ShapeError(f"ssd: dt_softplus={describe(dt_softplus)}: must be True or "
                             f"False")
        lo, hi = _dt_limit(dt_limit)
        self._keep_rule(layer, "ssd", Rule("ssd", False, False))
        stream = self.stream
        view = lambda a: device_view(a, stream)   # noqa: E731
        result = Result(x, None, (width, heads, head_dim), stream)
        ssd_kernel.apply(step.state_plan[RECURRENT], *self.storage.layers[layer][1:], view(x),
                         view(dt), view(A), view(B), view(C), None if D is None else view(D),
                         None if dt_bias is None else view(dt_bias), result.device,
                         bool(dt_softplus), lo, hi)
        step.ran[layer, RECURRENT] = True
        return result.value()

    def _keep_rule(self, layer: int, verb: str, rule: Rule) -> None:
        """Record `rule` as the layer's recurrence, or `ShapeError` if its steps ran
        another (nothing changed)."""
        kept = self.storage.rules.get(layer, rule)
        if kept != rule:
            raise ShapeError(f"{verb}: layer {layer} ran {_rule_name(kept)} before; a layer "
                             f"keeps one op, one gate and one rule (its replays and "
                             f"snapshots take them from its steps), got {_rule_name(rule)}")
        self.storage.rules[layer] = rule

    # ------------------------------------------------------------------ checks
    def _state_layer(self, step, layer, verb: str, part: int):
        """`(layer, kind)` of a state layer with part `part` not yet run this step, or
        `ShapeError` / `StepProtocolError`."""
        n_layers = self.config.n_layers
        if not is_int(layer) or not 0 <= layer < n_layers:
            raise ShapeError(f"{verb}: layer must be an int index in [0, {n_layers}), got "
                             f"{describe(layer)}")
        layer = int(layer)
        kind = self._kinds[layer]
        if not kind.keeps_state:
            raise ShapeError(f"{verb}: layer {layer} is {kind.describe()}, not a state layer; "
                             f"its data path is write / attend")
        if (kind.conv if part == CONV else kind.recurrent) is None:
            raise ShapeError(f"{verb}: state layer {layer} ({kind.describe()}) has no "
                             f"{'conv window' if part == CONV else 'recurrent state'}")
        if step.ran[layer, part]:
            raise StepProtocolError(f"{verb}: layer {layer} already ran {verb} in this step; "
                                    f"each op runs once per layer per step")
        return layer, kind


def _rule_name(rule: Rule) -> str:
    if rule.op == "ssd":
        return "ssd (Mamba2)"
    return (f"delta_rule with a {'per-channel' if rule.per_channel else 'per-head'} gate "
            f"{'with beta' if rule.has_beta else 'without beta (decay only)'}")


def _dt_limit(dt_limit) -> tuple:
    """`(lo, hi)` float32 of `dt_limit`, a pair of reals `lo <= hi` (not NaN; `hi` may
    be inf), else `ShapeError`."""
    try:
        lo, hi = (float(x) for x in dt_limit if not isinstance(x, (bool, np.bool_)))
    except (TypeError, ValueError):
        lo = hi = math.nan
    if not (lo <= hi and lo < math.inf and hi > -math.inf):
        raise ShapeError(f"ssd: dt_limit={describe(dt_limit)}: expected a pair (lo, hi) of "
                         f"reals with lo <= hi, e.g. (0.0, inf) (no clamp)")
    return np.float32(lo), np.float32(hi)


def _check_rows(step, name: str, array, shape: tuple, where: str, device: int,
                verb: str = "delta_rule") -> None:
    """`array` of `shape` (one row per token of the step), or `ShapeError` naming it."""
    check(name, array, None, IO_DTYPES, device)
    if tuple(array.shape) != shape:
        raise ShapeError(f"{verb}: {name}: expected shape {shape} {where}, got "
                         f"{tuple(array.shape)}{width_hint(step, array)}")
