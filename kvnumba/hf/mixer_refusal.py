"""The refusal of a model whose layers hold a stateful mixer kvnumba does not compute.

A hybrid model (Qwen3-Next, Qwen3.5, Kimi-Linear, OLMo-Hybrid: gated delta nets; LFM2:
short convolutions; Bamba, Granite-4, Jamba, Nemotron-H, Falcon-H1, Zamba: Mamba
mixers; RecurrentGemma: RG-LRU blocks; MiniMax: lightning attention) mixes its tokens
in some layers through a recurrent state instead of attention over K/V: its attention
layers go through `transformers`' AttentionInterface, the other layers never call it,
so a cache of K/V alone would serve another model. `refuse_mixers` finds those layers
(`stateful_mixers`: a decoder layer's module whose class is a stateful mixer,
`MIXER`) and refuses the model with a `ConfigError` naming each kind of them: the
layer's type (`layer_types`, where the config gives one), the mixer's class, and which
layers hold one. A pure recurrent model (RWKV, xLSTM) is refused the same way.

`COMPUTED` holds the mixer classes kvnumba computes (`mixers.MIXERS`, served on state
layers): they are not refused.
"""
from __future__ import annotations

import re

from ..errors import ConfigError
from .mixers import MIXERS

#: the class names of stateful mixers (a recurrent state, not K/V), searched in a class
#: name less its model's family prefix (`KimiLinearAttention` is Kimi-Linear's full
#: attention, `KimiLinearDeltaAttention` its delta attention): Mamba and Mamba-2 mixers,
#: gated delta nets and delta attention, lightning (linear) attention, short
#: convolutions, RG-LRU recurrent blocks, xLSTM's cells
MIXER = re.compile(r"Mamba|Mixer|DeltaNet|DeltaAttention|LightningAttention|LinearAttention|"
                   r"ShortConv|RecurrentBlock|Rglru|LSTM|SSM|Retention|Hyena")
#: stateful mixers whose class name says attention (RWKV's time mixing)
NAMED = {"RwkvSelfAttention"}
#: stateful mixer classes kvnumba computes (by class name): not refused
COMPUTED = frozenset(MIXERS)


def family(model) -> str:
    """The prefix of `model`'s module class names: its class name before `For`
    (`Qwen3NextForCausalLM`: `Qwen3Next`)."""
    return type(model).__name__.split("For")[0]


def is_mixer(cls: str, prefix: str) -> bool:
    """Whether class `cls` of a model of family `prefix` is a stateful mixer (`MIXER`,
    `NAMED`; a decoder layer holding one is not the mixer itself)."""
    if cls in NAMED:
        return True
    own = cls[len(prefix):] if prefix and cls.startswith(prefix) else cls
    return bool(MIXER.search(own)) and not own.endswith("DecoderLayer")


def stateful_mixers(model) -> list:
    """`(layer, class name)` of each outermost module inside a decoder layer of `model`
    (a module path with an index before its end, `model.layers.3.conv`) that is a
    stateful mixer (`is_mixer`) kvnumba does not compute (`COMPUTED`), in module order;
    `layer` is its `layer_idx`, else the first index in its path."""
    found, inside, prefix = [], [], family(model)
    for name, module in model.named_modules():
        parts = name.split(".")
        if not any(part.isdigit() for part in parts[:-1]) or \
                any(name.startswith(outer + ".") for outer in inside):
            continue
        cls = type(module).__name__
        if not is_mixer(cls, prefix) or cls in COMPUTED:
            continue
        inside.append(name)
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            layer = int(next(part for part in parts if part.isdigit()))
        found.append((layer, cls))
    return found


def layer_types(config) -> list:
    """The config's type of each decoder layer (`layer_types`, a property or
    `attribute_map` name included), or []."""
    try:
        types = getattr(config, "layer_types", None)
    except Exception:                       # noqa: BLE001  (a property that cannot say)
        types = None
    return list(types) if isinstance(types, (list, tuple)) else []


def refuse_mixers(model, config) -> None:
    """`ConfigError` naming the stateful mixers of `model` (`stateful_mixers`) by kind:
    each kind's first layer, that layer's type in `config` (its text config) and the
    mixer's class, then every layer holding one; nothing where it has none."""
    mixers = stateful_mixers(model)
    if not mixers:
        return
    types = layer_types(config)
    kinds: dict = {}
    for layer, cls in mixers:
        kind = types[layer] if layer is not None and layer < len(types) else None
        kinds.setdefault((kind, cls), []).append(layer)
    described = [f"layer {layers[0]} is a {kind!r} layer ({cls})" if kind else
                 f"layer {layers[0]} holds a {cls}" for (kind, cls), layers in kinds.items()]
    layers = sorted({layer for layer, _ in mixers})
    total = getattr(config, "num_hidden_layers", None)
    of = f" of {total}" if isinstance(total, int) else ""
    these = "this mixer" if len(kinds) == 1 else "these mixers"
    raise ConfigError(f"{config.model_type}: {'; '.join(described)}: kvnumba does not compute "
                      f"{these}, a recurrent state rather than attention over K/V through "
                      f"transformers' AttentionInterface (mixer layers {layers}{of}), so it "
                      f"cannot serve the model")
