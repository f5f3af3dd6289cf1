"""Multi-head latent attention served from a latent cache (contract §16): the DeepSeek
family's attention modules (DeepSeek-V2/V3 and the models built on their attention:
a `kv_a_layernorm`, a `kv_b_proj`, `qk_nope_head_dim`, `v_head_dim`).

Such a module compresses each token to a latent `c` (`kv_lora_rank` values, after
`kv_a_layernorm`) and a rotary key `k_rot` (`qk_rope_head_dim` values, shared by every
head), then expands per head `k_nope = W_UK c` and `v = W_UV c` (`kv_b_proj`) before it
calls the attention interface. kvnumba keeps the latent instead: the cache's layer is
`kv.latent(rank, rope_dim)`, one row `[c, k_rot]` per token. During a step a forward
hook on `kv_a_layernorm` (installed by `capturing` for the step, removed after) keeps
`c` (times the module's scale of its latent, where it has one: `LATENT_SCALES`); the
attention call brings `k_rot` (the last `qk_rope_head_dim` values of its keys,
copied there unchanged) and the queries. The call then attends in absorbed form:
`q_nope · k_nope = (W_UK^T q_nope) · c`, so the query `[W_UK^T q_nope, q_rot]` over the
rows gives each head's scores exactly, and its output over the latents times `W_UV`
each head's `v` sum. Everything else (projections, norms, RoPE, `o_proj`) is the
module's own.

Rounding: the absorbed query and the output's expansion are two matrix products in the
model's dtype the expanded form does not have (and it skips two); in float32 the
probe's 1e-3 bound holds with room, and the tests serve tiny DeepSeek-V3 models token for
token.
"""
from __future__ import annotations

import contextlib

from ..errors import ConfigError


#: the attributes by which a module scales its latent after `kv_a_layernorm` (LongCat-Flash,
#: dots.llm3), a number the hook multiplies the kept latent by
LATENT_SCALES = ("mla_scale_kv_lora", "kv_lora_scale")


def latent_scale(module):
    """The number `module` multiplies its normed latent by (`LATENT_SCALES`), or None."""
    for name in LATENT_SCALES:
        value = getattr(module, name, None)
        if value is not None:
            return value
    return None


def latent_modules(model) -> dict:
    """Decoder layer index -> attention module computing latent attention (a
    `kv_a_layernorm` and a `kv_b_proj`), first of each index."""
    found: dict = {}
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and hasattr(module, "kv_a_layernorm") and \
                hasattr(module, "kv_b_proj") and layer not in found:
            found[layer] = module
    return found


def refuse_modules(model, model_type: str) -> None:
    """`ConfigError` for latent modules kvnumba cannot serve exactly: an indexer
    selecting keys (DeepSeek-V3.2's sparse attention), a `kv_b_proj` with a bias, or
    the head dims it needs missing."""
    for layer, module in sorted(latent_modules(model).items()):
        if getattr(module, "indexer", None) is not None:
            raise ConfigError(f"{model_type}: layer {layer}'s attention selects its keys "
                              f"with an indexer (indexed, sparse attention); kvnumba "
                              f"attends over every key")
        if getattr(module.kv_b_proj, "bias", None) is not None:
            raise ConfigError(f"{model_type}: layer {layer}'s kv_b_proj has a bias; the "
                              f"absorbed form kvnumba computes needs none")
        for name in ("qk_nope_head_dim", "v_head_dim"):
            if not isinstance(getattr(module, name, None), int):
                raise ConfigError(f"{model_type}: layer {layer}'s latent attention module "
                                  f"has no {name}")


@contextlib.contextmanager
def capturing(model, layers: list):
    """Inside the block, each latent module of `layers` (indices) keeps its step's
    latents: yields a dict that a forward hook on its `kv_a_layernorm` fills, layer ->
    `[1, T, rank]` (times the module's `latent_scale`); the hooks are removed after."""
    latents: dict = {}
    modules = latent_modules(model)
    handles = []
    try:
        for layer in layers:
            def keep(_module, _inputs, output, layer=layer,
                     scale=latent_scale(modules[layer])):
                latents[layer] = output if scale is None else output * scale
            handles.append(modules[layer].kv_a_layernorm.register_forward_hook(keep))
        yield latents
    finally:
        for handle in handles:
            handle.remove()


def attend(cache, module, layer: int, query, key, latents: dict, scaling):
    """`out [1, T, Hq, v_head_dim]` of latent layer `layer` for the step: its rows
    `[c, k_rot]` written and its absorbed queries attended (module doc). `query`
    `[1, Hq, T, nope + rope]`, `key` `[1, Hq, T, nope + rope]` as the module hands them."""
    import torch
    if layer not in latents:
        raise ConfigError(f"layer {layer}: its latents were not kept this step (the module's "
                          f"kv_a_layernorm did not run)")
    nope, v_dim = module.qk_nope_head_dim, module.v_head_dim
    c = latents[layer][0]                                    # [T, rank]
    rows = torch.cat([c, key[0, 0, :, nope:]], dim=-1)[:, None, :].contiguous()
    weight = module.kv_b_proj.weight
    weight = weight.to_local() if hasattr(weight, "to_local") else weight
    w = weight.view(-1, nope + v_dim, c.shape[-1])           # [Hq, nope + v, rank]
    q = query[0].transpose(0, 1)                             # [T, Hq, nope + rope]
    absorbed = torch.cat([torch.einsum("thn,hnr->thr", q[..., :nope], w[:, :nope]),
                          q[..., nope:]], dim=-1).contiguous()
    out = cache.update_and_attend(layer, absorbed, rows, None, scale=scaling)
    return torch.einsum("thr,hvr->thv", out, w[:, nope:]).unsqueeze(0)
