"""The data path of a prepared step on state layers (contract §17): `conv` and
`delta_rule`, each checked whole before anything launches.

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
from ..refusals import width_hint
from .arrays import Result, check, device_view
from .attend import IO_DTYPES

#: an op's parts, as `OpenStep.ran` counts them: the conv window, the recurrent state
CONV, RECURRENT = 0, 1
#: what `conv`'s `activation` may be
ACTIVATIONS = (None, "silu")


class StatePath:
    """`conv` / `delta_rule` of one cache: its `config`, `device`, `stream` and state
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
        stream = self.stream
        arrays = self.storage.layers[layer]
        result = Result(q, None, (step.width, heads, dv), stream)
        rule = (len(g.shape) == 3, beta is not None)
        if self.storage.rules.setdefault(layer, rule) != rule:
            raise ShapeError(f"delta_rule: layer {layer} ran with a {_rule_name(*self.storage.rules[layer])} "
                             f"before; a layer keeps one gate and one rule (its replays "
                             f"and snapshots take them from its steps), got a "
                             f"{_rule_name(*rule)}")
        view = lambda a: device_view(a, stream)   # noqa: E731
        step.state_plan[RECURRENT](
            arrays.state, arrays.base, arrays.log_k, arrays.log_v, arrays.log_g, arrays.log_b,
            arrays.marks, view(q), view(k), view(v), view(g),
            None if beta is None else view(beta), result.device, scale, bool(qk_l2norm))
        step.ran[layer, RECURRENT] = True
        return result.value()

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


def _rule_name(per_channel: bool, has_beta: bool) -> str:
    return (f"{'per-channel' if per_channel else 'per-head'} gate "
            f"{'with beta' if has_beta else 'without beta (decay only)'}")


def _check_rows(step, name: str, array, shape: tuple, where: str, device: int) -> None:
    """`array` of `shape` (one row per token of the step), or `ShapeError` naming it."""
    check(name, array, None, IO_DTYPES, device)
    if tuple(array.shape) != shape:
        raise ShapeError(f"delta_rule: {name}: expected shape {shape} {where}, got "
                         f"{tuple(array.shape)}{width_hint(step, array)}")
