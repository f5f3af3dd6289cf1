"""Which cache layer each part of each decoder layer of a `transformers` model uses
(contract §17).

A decoder layer holds attention, a mixer (`kvnumba.hf.mixers`), both, or neither:

- an attention layer (`full_attention`, `sliding_attention`, `chunked_attention`) or a
  mixer layer (`linear_attention`, `conv`, `mamba`) maps to one cache layer;
- a layer of attention and a mixer side by side (`hybrid`, `hybrid_sliding`: every
  Falcon-H1 layer, Zamba2's shared-attention layers) maps to two, its attention's
  first, then its mixer's state layer;
- a layer that mixes no tokens (Nemotron-H's `mlp` and `moe` layers) maps to none: it
  stores nothing, so the cache has no layer for it.

Cache layers follow the decoder layers in order, so a model whose every layer is one
part (attention or a mixer) has cache layer `i` for decoder layer `i` (`identity`).
`layer_map` builds the map from the config's layer types and the layers holding a mixer;
the cache config is laid out by it (`config.layer_specs`), the attention function reads a
layer's cache layer through it (`attention.attend`), and so do the mixers
(`mixing.running`).

An attention module that decoder layers share (Zamba2's shared transformer block, its
`layer_idx` -1, none of theirs) is told which one calls it: `sharing` sets its
`layer_idx` to the calling decoder layer's index for the call.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

#: layer types of attention and a mixer in one decoder layer
HYBRID = ("hybrid", "hybrid_sliding")
#: layer types that mix no tokens (an MLP or experts alone): no cache layer
STORE_NOTHING = ("mlp", "moe")


class LayerMap(NamedTuple):
    """`attention`: decoder layer -> the cache layer of its attention; `mixers`: decoder
    layer -> the cache layer of its mixer's state; `n_layers`: the cache's layers."""

    attention: dict
    mixers: dict
    n_layers: int

    @property
    def identity(self) -> bool:
        """Whether decoder layer `i` is cache layer `i`, each holding one part."""
        return all(layer == cache for layer, cache in
                   list(self.attention.items()) + list(self.mixers.items()))

    def parts(self) -> list:
        """`(decoder layer, "attention" or "mixer")` of each cache layer, in order."""
        found = [None] * self.n_layers
        for part, layers in (("attention", self.attention), ("mixer", self.mixers)):
            for layer, cache in layers.items():
                found[cache] = (layer, part)
        return found


def attends(layer_type: str, has_mixer: bool) -> bool:
    """Whether a decoder layer of `layer_type` (holding a mixer or not) has attention: a
    hybrid one always, a mixer's one never, a layer of `STORE_NOTHING` never."""
    if layer_type in HYBRID:
        return True
    return not has_mixer and layer_type not in STORE_NOTHING


def layer_map(layer_types: list, mixer_layers) -> LayerMap:
    """The `LayerMap` of decoder layers of `layer_types` (one per layer), those of
    `mixer_layers` holding a mixer: each layer's attention (`attends`), then its mixer,
    take the next cache layers."""
    attention, mixers, n = {}, {}, 0
    for layer, layer_type in enumerate(layer_types):
        if attends(layer_type, layer in mixer_layers):
            attention[layer], n = n, n + 1
        if layer in mixer_layers:
            mixers[layer], n = n, n + 1
    return LayerMap(attention, mixers, n)


def shared_attention(model) -> list:
    """`(decoder layer module, its index, attention module)` for each attention module
    inside a decoder layer (a module path `....layers.<i>....`) whose `layer_idx` is not
    that layer's index `i`: a module the decoder layers share, found under each of them
    (Zamba2's shared transformer block, `layer_idx` -1)."""
    found = []
    for name, module in model.named_modules(remove_duplicate=False):
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if index is None or index == len(parts) - 1 or \
                not type(module).__name__.endswith("Attention") or \
                getattr(module, "layer_idx", None) in (None, int(parts[index])):
            continue
        found.append((model.get_submodule(".".join(parts[:index + 1])), int(parts[index]),
                      module))
    return found


@contextmanager
def sharing(shared: list):
    """Inside the block, each decoder layer of `shared` (`shared_attention`) sets its
    shared attention module's `layer_idx` to its own index while it runs."""
    for owner, layer, module in shared:
        owner.forward = _calling(owner, layer, module)
    try:
        yield
    finally:
        for owner, _, _ in shared:
            owner.__dict__.pop("forward", None)


def _calling(owner, layer: int, module):
    run = type(owner).forward.__get__(owner)

    def forward(*args, **kwargs):
        before, module.layer_idx = module.layer_idx, layer
        try:
            return run(*args, **kwargs)
        finally:
            module.layer_idx = before
    return forward
