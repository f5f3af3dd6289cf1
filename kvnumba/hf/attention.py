"""The attention function kvnumba registers with `transformers`.

Each layer's call receives the step's `query [1, Hq, T, D]` and new `key` / `value
[1, Hkv, T, D]` (after RoPE) and the cache of the running step (the `kvnumba_cache`
keyword the engine passes to the model, which `transformers` forwards to every
attention call). It writes K/V into the cache and attends each token over its own
sequence's history: the step's masks are the cache's (positions, spans, windows), so
no mask is built for it.
"""
from __future__ import annotations

from ..errors import ConfigError

#: the name models are switched to: `model.set_attn_implementation(ATTENTION)`
ATTENTION = "kvnumba"


def attend(module, query, key, value, attention_mask=None, *, scaling=None, dropout=0.0,
           sliding_window=None, softcap=None, kvnumba_cache=None, **_):
    """`(out [1, T, Hq, D], None)`: `update_and_attend` of the prepared step on layer
    `module.layer_idx`, with the module's scale and softcap."""
    if kvnumba_cache is None:
        raise ConfigError("the kvnumba attention runs inside a kvnumba step: call the model "
                          "through kvnumba.hf.Engine (kvnumba_cache=... not given)")
    layer = module.layer_idx
    window = kvnumba_cache.config.layers[layer].window
    if (sliding_window or None) != window:
        raise ConfigError(f"layer {layer}: the model attends with sliding_window="
                          f"{sliding_window}, the cache's layer has window {window}")
    if dropout:
        raise ConfigError(f"layer {layer}: attention dropout {dropout} (put the model in "
                          f"eval mode)")
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    out = kvnumba_cache.update_and_attend(layer, q, k, v, scale=scaling, softcap=softcap or None)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    """The mask function for `ATTENTION`: none (the cache masks by positions)."""
    return None


def register() -> None:
    """Register the attention function as `ATTENTION` with `transformers`, and no mask
    creation for it (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(ATTENTION, attend)
    AttentionMaskInterface.register(ATTENTION, _no_mask)
