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
from . import latent

#: the name models are switched to: `model.set_attn_implementation(ATTENTION)`
ATTENTION = "kvnumba"

#: arguments of an attention call that change nothing kvnumba computes: positions and
#: packing the step already has (the cache's positions and spans), and the model's own
#: cache and output options, which a step served through kvnumba does not use (a
#: composite model hands its language model's `logits_to_keep` down to the layers)
IGNORED = frozenset({
    "position_ids", "cache_position", "position_embeddings", "use_cache", "past_key_values",
    "past_key_value", "output_hidden_states", "output_router_logits", "return_dict",
    "logits_to_keep",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
})
#: arguments that ask for attention kvnumba does not compute yet, by what they are
NOT_COMPUTED = {
    "position_bias": "a position bias added to the scores",
    "indices": "sparse (indexed) attention",
    "block_indices": "sparse (indexed) attention",
}


def attend(module, query, key, value, attention_mask=None, *, scaling=None, dropout=0.0,
           sliding_window=None, softcap=None, s_aux=None, is_causal=None,
           output_attentions=False, kvnumba_cache=None, kvnumba_latents=None,
           kvnumba_layers=None, **others):
    """`(out [1, T, Hq, D], None)`: `update_and_attend` of the prepared step on the cache
    layer of decoder layer `module.layer_idx` (itself, or `kvnumba_layers[layer_idx]`
    where the model's decoder layers are not its cache layers: `layermap.LayerMap.
    attention`), with the module's scale, softcap and learned sinks (`s_aux`,
    `[Hq]`: each head's logit joins its softmax); on a shared layer (`kv.shared`), whose
    `key` / `value` are its producer's, `attend` over the producer's K/V as the step
    wrote them; on a latent layer (`kv.latent`), the absorbed form over its rows
    (`kvnumba.hf.latent.attend`, the step's latents in `kvnumba_latents`).

    Accepted means exact: every argument is either computed (`scaling`, `softcap`,
    `s_aux`, the cache layer's `sliding_window`), known to change nothing (`IGNORED`; no mask: the
    cache masks by positions), or refused with a `ConfigError` naming the layer and the
    argument before anything is written (`NOT_COMPUTED`, a non-causal call, attention
    weights asked for, dropout, and any argument this function does not know)."""
    if kvnumba_cache is None:
        raise ConfigError("the kvnumba attention runs inside a kvnumba step: call the model "
                          "through kvnumba.hf.Engine (kvnumba_cache=... not given)")
    layer = cache_layer(module.layer_idx, kvnumba_layers)
    refuse_arguments(layer, is_causal=is_causal, output_attentions=output_attentions,
                     dropout=dropout, others=others)
    config = kvnumba_cache.config
    window = config.reads[layer].window
    if (sliding_window or None) != window:
        raise ConfigError(f"layer {layer}: the model attends with sliding_window="
                          f"{sliding_window}, the cache's layer has window {window}")
    if config.kinds[layer].name == "latent":
        if softcap or s_aux is not None or kvnumba_latents is None:
            raise ConfigError(f"layer {layer}: latent attention with a softcap or sinks, or "
                              f"outside a step that keeps its latents")
        return latent.attend(kvnumba_cache, module, layer, query, key, kvnumba_latents,
                             scaling), None
    q = query[0].transpose(0, 1).contiguous()
    sinks = None if s_aux is None else head_sinks(layer, s_aux, q.shape[1])
    if not config.layers[layer].stores:    # the producer's K/V, written earlier this step
        out = kvnumba_cache.attend(layer, q, scale=scaling, softcap=softcap or None,
                                   sinks=sinks)
        return out.unsqueeze(0), None
    k, v = (x[0].transpose(0, 1).contiguous() for x in (key, value))
    out = kvnumba_cache.update_and_attend(layer, q, k, v, scale=scaling, softcap=softcap or None,
                                          sinks=sinks)
    return out.unsqueeze(0), None


def cache_layer(layer: int, layers: dict | None) -> int:
    """The cache layer of decoder layer `layer`'s attention: `layers[layer]`, or `layer`
    without `layers`; `ConfigError` for a decoder layer the map gives no attention."""
    if layers is None:
        return layer
    if layer not in layers:
        raise ConfigError(f"decoder layer {layer} calls attention, and the cache laid out "
                          f"none for it (attention layers {sorted(layers)})")
    return layers[layer]


def head_sinks(layer: int, s_aux, n_heads: int):
    """A layer's learned sinks as the cache takes them: float32 `[n_heads]`, detached
    (a parameter requires grad), this rank's share of a tensor-parallel model's heads
    (a sharded parameter's local part; a replicated one sliced by the rank), or
    `ConfigError` naming the counts."""
    sinks = s_aux.to_local() if hasattr(s_aux, "to_local") else s_aux
    sinks = sinks.detach().reshape(-1).float()
    if sinks.shape[0] == n_heads:
        return sinks
    import torch.distributed as dist
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if sinks.shape[0] == n_heads * ranks:
        rank = dist.get_rank()
        return sinks[rank * n_heads:(rank + 1) * n_heads].contiguous()
    raise ConfigError(f"layer {layer}: the model's sinks hold {sinks.shape[0]} heads, its "
                      f"queries {n_heads} (on {ranks} rank(s)); kvnumba takes one sink per "
                      f"query head")


def refuse_arguments(layer: int, *, is_causal, output_attentions, dropout, others: dict) -> None:
    """`ConfigError` naming layer `layer` and the first argument of its attention call that
    kvnumba would not compute exactly (`attend`'s doc)."""
    if is_causal is not None and not is_causal:
        raise ConfigError(f"layer {layer}: the model attends with is_causal={is_causal} "
                          f"(bidirectional attention); kvnumba computes causal attention only")
    if output_attentions:
        raise ConfigError(f"layer {layer}: the model asks for its attention weights "
                          f"(output_attentions=True); kvnumba returns none")
    if dropout:
        raise ConfigError(f"layer {layer}: attention dropout {dropout} (put the model in "
                          f"eval mode)")
    for name, value in others.items():
        if name in IGNORED or value is None:
            continue
        what = NOT_COMPUTED.get(name, "an argument kvnumba's attention does not know")
        raise ConfigError(f"layer {layer}: the model's attention passes {name}= ({what}), "
                          f"which kvnumba does not compute; it cannot serve this model "
                          f"exactly")


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
