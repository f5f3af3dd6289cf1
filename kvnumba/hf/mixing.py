"""A hybrid model's mixers on the cache's state layers (contract §17): which decoder layers
are mixers (`mixers.mixer_layers`), the state layer each needs (`state_specs`), and their
`forward` switched to kvnumba's for a step (`running`).

Inside a step a mixer module's own `forward` is replaced (on the instance, for the
step only) by `mixers.forward`, which calls the module's own projections, norms and
gates and runs its convolution and recurrence on the cache (`LayerOps`: `conv`,
`delta_rule` and `ssd` of its layer) over the packed step. A layer whose mixer kvnumba does not
compute is refused at construction (`config.layer_specs`), naming its layer type.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

from ..layerspec import state
from . import mixers

def state_specs(model) -> dict:
    """Decoder layer index -> the `kv.state` layer its mixer keeps (`mixers.state_shape`)."""
    specs = {}
    for layer, module in mixers.mixer_layers(model).items():
        conv, recurrent = mixers.state_shape(module)
        specs[layer] = state(conv=conv, recurrent=recurrent)
    return specs


class LayerOps:
    """The state ops of `cache`'s layer `layer`, as `mixers` calls them."""

    __slots__ = ("cache", "layer")

    def __init__(self, cache, layer: int):
        self.cache, self.layer = cache, layer

    def conv(self, x, weight, bias=None, activation=None):
        return self.cache.conv(self.layer, *_contiguous(x, weight, bias),
                               activation=activation)

    def delta_rule(self, q, k, v, g, beta, *, scale=None, qk_l2norm=False):
        return self.cache.delta_rule(self.layer, *_contiguous(q, k, v, g, beta), scale=scale,
                                     qk_l2norm=qk_l2norm)

    def ssd(self, x, dt, A, B, C, *, D=None, dt_bias=None, dt_limit=(0.0, math.inf)):
        D, dt_bias = _contiguous(D, dt_bias)
        return self.cache.ssd(self.layer, *_contiguous(x, dt, A, B, C), D=D, dt_bias=dt_bias,
                              dt_limit=dt_limit)


def _contiguous(*tensors):
    """`tensors` contiguous (None stays None)."""
    return [None if t is None else t.contiguous() for t in tensors]


@contextmanager
def running(modules: dict, cache):
    """Each of `modules` (cache layer -> the mixer module computing through it: a decoder
    layer's mixer at its `layermap.LayerMap` cache layer) computing through `cache`'s
    state layers inside the block: its `forward` takes the step's `hidden_states [1, T, hidden]` (any other
    argument, a padding mask or the model's own cache, changes nothing kvnumba computes:
    the cache keeps the states and knows the step's sequences)."""
    for layer, module in modules.items():
        module.forward = _forward(module, LayerOps(cache, layer))
    try:
        yield
    finally:
        for module in modules.values():
            del module.forward


def _forward(module, ops):
    def forward(hidden_states=None, *args, **kwargs):
        return mixers.forward(module, hidden_states[0], ops)[None]
    return forward
