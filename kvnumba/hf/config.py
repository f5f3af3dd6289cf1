"""A `transformers` model config mapped onto a `CacheConfig`, or refused; the configs of
an engine's caches (the model's and its draft's, sharing a byte budget).

Only what the attention interface hands kvnumba is served: per-layer causal attention
over the sequence's own keys, full, sliding-window or chunked (`layer_types`,
`sliding_window`, `attention_chunk_size`), grouped kv heads, a score scale, a logit
softcap and learned attention sinks, layers of several shapes (head dims and kv heads
per layer), layers that read an earlier layer's K/V (`num_kv_shared_layers`) and latent
attention (`kv_lora_rank`: latent layers, `kvnumba.hf.latent`). What kvnumba cannot
compute exactly (ALiBi, cross-attention, indexed sparse attention, linear attention
layers, layers that read K/V from outside the model, a query scale by position past
what a step tells the model) is a `ConfigError` naming the model type and the missing
piece, never a silently different model. Attributes a config holds per
layer (`per_layer_attributes`, Gemma 4's head dim and kv heads) are read per layer.
"""
from __future__ import annotations

from ..args import as_count, is_int
from ..config import CacheConfig, chunked, flat, latent, ring, shared
from ..errors import ConfigError
from .latent import latent_modules, refuse_modules
from .layermap import HYBRID, LayerMap, layer_map
from .mixer_refusal import refuse_mixers
from .mixers import MIXERS
from .mixing import state_specs
from .sharding import kv_heads_per_rank, sharding

#: the `layer_types` kvnumba computes
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
#: the layer types of hybrid models (mixers, and layers that attend not): `layer_specs`
#: lays out each such layer whose mixer kvnumba computes, or refuses it naming the layer
LAID_OUT_BY_LAYER = ("linear_attention", "conv", "mamba", "hybrid", "hybrid_sliding", "mlp",
                     "moe")
#: the cache's default K/V shape `(kv heads, head_dim, v_head_dim)` for a model without
#: attention (Mamba2): every cache layer is a state layer, none reads it
NO_ATTENTION = (1, 1, 1)
#: storage dtypes by the model's torch dtype name
_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def text_config(model_config):
    """The decoder's config (a multimodal config's text part, else the config itself)."""
    get = getattr(model_config, "get_text_config", None)
    return get() if get is not None else model_config


def unsupported(config) -> str | None:
    """What of the model kvnumba cannot serve exactly, or None."""
    if getattr(config, "is_encoder_decoder", False):
        return "cross-attention (an encoder-decoder model)"
    if getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None),
                                                   "alibi", False):
        return "ALiBi position biases"
    shared_layers = getattr(config, "num_kv_shared_layers", 0) or 0
    if shared_layers and shared_layers >= config.num_hidden_layers:
        return (f"layers that all attend over K/V from outside the model "
                f"(num_kv_shared_layers={shared_layers} of {config.num_hidden_layers})")
    for layer_type in set(getattr(config, "layer_types", None) or ()):
        if layer_type not in LAYER_TYPES + LAID_OUT_BY_LAYER:
            return f"{layer_type!r} layers"
    return None


def per_layer_values(config, name: str) -> list:
    """`name` of each layer of a config whose attention attributes may vary by layer
    (`per_layer_attributes`, read through `per_layer_config`), else `[name]` of the
    config once (or `[]` without it)."""
    if name in (getattr(config, "per_layer_attributes", None) or ()):
        return [getattr(layer, name, None) for layer in config.per_layer_config]
    value = getattr(config, name, None)
    return [] if value is None else [value]


def layer_value(config, name: str, layer: int):
    """Attribute `name` of decoder layer `layer` (`per_layer_values`), or None."""
    values = per_layer_values(config, name)
    return values[layer] if len(values) > 1 else (values[0] if values else None)


def module_shapes(model) -> dict:
    """Decoder layer index -> `(head_dim, kv groups, v_head_dim, query heads)` as its
    attention module holds them (`head_dim`, `num_key_value_groups`, `v_head_dim`,
    `num_heads` or `num_attention_heads`; None where the module has no such attribute):
    the modules are what the attention interface hands kvnumba, so they rule where the
    config says otherwise (MiMo-V2-Flash's sliding layers hold twice the config's kv
    heads, and its V heads are narrower than K's; Laguna's query heads vary by layer,
    `num_attention_heads_per_layer`). The first module of each index counts, a mixer
    (`mixers.MIXERS`: Falcon-H1's beside its layer's attention, its `head_dim` the SSM
    heads') none."""
    found: dict = {}
    for module in model.modules():
        layer, head_dim = getattr(module, "layer_idx", None), getattr(module, "head_dim", None)
        if is_int(layer) and is_int(head_dim) and int(layer) not in found and \
                type(module).__name__ not in MIXERS:
            groups, v_head_dim, heads, attention_heads = (
                getattr(module, name, None) for name in
                ("num_key_value_groups", "v_head_dim", "num_heads", "num_attention_heads"))
            heads = heads if is_int(heads) else attention_heads
            found[int(layer)] = (int(head_dim),) + tuple(
                int(value) if is_int(value) else None for value in (groups, v_head_dim, heads))
    return found


def layer_shapes(config, ranks: int, modules: dict | None = None, silent=()) -> list:
    """`(kv heads, head_dim, v_head_dim)` of each decoder layer on one of `ranks` ranks:
    what its attention module holds (`module_shapes`: its query heads over its kv groups),
    else the config's `num_attention_heads`, `num_key_value_heads` and `head_dim` (else
    `hidden_size // num_attention_heads`), read per layer where the config holds them per
    layer (`ConfigError` where no query head count is given); the kv heads are this rank's
    share (`kv_heads_per_rank`), V as wide as K unless the module says otherwise. A layer
    of `silent` (without attention: a mixer's, or an MLP's alone) has None."""
    shapes = []
    for layer in range(config.num_hidden_layers):
        if layer in silent:
            shapes.append(None)
            continue
        head_dim, groups, v_head_dim, heads = (modules or {}).get(layer, (None,) * 4)
        heads = heads or layer_value(config, "num_attention_heads", layer)
        if not is_int(heads) or heads < 1:
            raise ConfigError(f"{config.model_type}: layer {layer}'s query head count is "
                              f"{heads!r} (num_attention_heads, neither its attention module "
                              f"nor its config gives a positive count); kvnumba needs it "
                              f"to lay out the layer's kv heads")
        head_dim = head_dim or layer_value(config, "head_dim", layer) or \
            config.hidden_size // heads
        kv_heads = heads // groups if groups else \
            layer_value(config, "num_key_value_heads", layer) or heads
        shapes.append((kv_heads_per_rank(heads, kv_heads, ranks, model_type=config.model_type),
                       head_dim, v_head_dim or head_dim))
    return shapes


def producers(config) -> list:
    """Per decoder layer the layer whose K/V it reads (`num_kv_shared_layers`, Gemma 4:
    each of the last layers reads the last earlier layer of its type), None for a layer
    that stores its own."""
    n_shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if not n_shared:
        return [None] * config.num_hidden_layers
    layer_types = list(getattr(config, "layer_types", None) or
                 ["full_attention"] * config.num_hidden_layers)
    first = config.num_hidden_layers - n_shared
    found = []
    for layer, layer_type in enumerate(layer_types):
        if layer < first:
            found.append(None)
            continue
        earlier = [i for i in range(first) if layer_types[i] == layer_type]
        if not earlier:
            raise ConfigError(f"{config.model_type}: layer {layer} ({layer_type}) shares K/V, and "
                              f"no earlier layer of its type stores any")
        found.append(earlier[-1])
    return found


def decoder_layer_types(config) -> list:
    """The type of each decoder layer: `layer_types` when the config has them, else every
    layer sliding when `sliding_window` is set, else every layer full (`ConfigError`
    where `layer_types` does not list every layer)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        window = getattr(config, "sliding_window", None)
        return ["sliding_attention" if window else "full_attention"] * \
            config.num_hidden_layers
    if len(layer_types) != config.num_hidden_layers:
        raise ConfigError(f"{config.model_type}: layer_types lists {len(layer_types)} layers, "
                          f"the model has {config.num_hidden_layers}")
    return list(layer_types)


def model_layer_map(config, states: dict | None = None) -> LayerMap:
    """The `LayerMap` of a model of `config` whose decoder layers of `states`
    (`mixing.state_specs`) hold a mixer (`layermap.layer_map`)."""
    return layer_map(decoder_layer_types(config), states or {})


def layer_specs(config, shapes: list | None = None, states: dict | None = None) -> list:
    """One `LayerSpec` per cache layer, in the order of `model_layer_map` (a decoder
    layer's attention, then its mixer; none for a layer that mixes no tokens). Attention
    by its layer type (`decoder_layer_types`; a `chunked_attention` layer chunked by
    `attention_chunk_size`, a `hybrid` layer's full, a `hybrid_sliding` layer's
    sliding); with `shapes` (`layer_shapes`), each layer's kv heads and head dims where
    they are not the first attention layer's; a layer that reads another's K/V is
    `shared` with it (`producers`); a mixer the state layer of `states`
    (`mixing.state_specs`). Any other layer type, and a hybrid layer holding no mixer of
    `states` (Zaya's), is refused (`ConfigError` naming it)."""
    states = states or {}
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    layer_types = decoder_layer_types(config)
    sliding = {"sliding_attention", "hybrid_sliding"} & set(layer_types)
    if sliding and not window:
        raise ConfigError(f"{config.model_type}: {sorted(sliding)[0]} layers without a "
                          f"sliding_window")
    if "chunked_attention" in layer_types and not chunk:
        raise ConfigError(f"{config.model_type}: chunked_attention layers without an "
                          f"attention_chunk_size")
    ring_layer = lambda **s: ring(int(window), **s)      # noqa: E731
    made = {"full_attention": flat, "sliding_attention": ring_layer,
            "chunked_attention": lambda **s: chunked(int(chunk), **s),
            "hybrid": flat, "hybrid_sliding": ring_layer}
    mapped = layer_map(layer_types, states)
    specs = [None] * mapped.n_layers
    for layer, (layer_type, producer) in enumerate(zip(layer_types, producers(config))):
        if layer in mapped.mixers:
            specs[mapped.mixers[layer]] = states[layer]
        if layer not in mapped.attention:
            continue
        if producer is not None:
            specs[mapped.attention[layer]] = shared(mapped.attention[producer])
            continue
        if layer_type in HYBRID and layer not in states:
            raise ConfigError(f"{config.model_type}: layer {layer} is a {layer_type!r} layer, "
                              f"attention beside a mixer, and holds no mixer kvnumba "
                              f"computes (kvnumba.hf.mixers), so kvnumba does not lay out "
                              f"its state")
        if layer_type not in made:
            raise ConfigError(f"{config.model_type}: layer {layer} is a {layer_type!r} layer, "
                              f"which kvnumba does not lay out (it serves "
                              f"{', '.join(LAYER_TYPES)} layers and the mixer layers of "
                              f"kvnumba.hf.mixers)")
        specs[mapped.attention[layer]] = made[layer_type](**_own_shape(shapes, layer))
    return specs


def first_shape(shapes: list) -> tuple:
    """The first attention layer's shape of `shapes` (`layer_shapes`): the cache's
    defaults; `NO_ATTENTION` for a model of mixers alone (no layer reads them)."""
    return next((shape for shape in shapes if shape is not None), NO_ATTENTION)


def _own_shape(shapes: list | None, layer: int) -> dict:
    """The shape arguments of `layer` (`layer_shapes`) where they differ from the cache's
    defaults (the first layer's kv heads and head dim; V as wide as K)."""
    if shapes is None:
        return {}
    (heads, head_dim, _), (own_heads, own_dim, own_v) = first_shape(shapes), shapes[layer]
    given = dict(n_kv_heads=own_heads, head_dim=own_dim, v_head_dim=own_v)
    defaults = dict(n_kv_heads=heads, head_dim=head_dim, v_head_dim=own_dim)
    return {name: value for name, value in given.items() if value != defaults[name]}


def latent_specs(model, config, ranks: int, states: dict | None = None) -> list:
    """One `kv.latent(kv_lora_rank, qk_rope_head_dim)` per decoder layer of a model whose
    attention is latent (`kv_lora_rank`: `kvnumba.hf.latent`): every rank holds the
    latent whole and attends its share of the query heads. `ConfigError` for layers
    other than full attention, heads its ranks cannot share, or a module kvnumba cannot
    serve (`latent.refuse_modules`). A mixer's layer is the state layer of `states`
    (`mixing.state_specs`; Kimi-Linear's KDA layers beside its latent ones)."""
    states = states or {}
    layer_types = set(t for i, t in enumerate(getattr(config, "layer_types", None) or
                                              ("full_attention",)) if i not in states)
    if layer_types != {"full_attention"}:
        raise ConfigError(f"{config.model_type}: latent attention over "
                          f"{sorted(layer_types - {'full_attention'})} layers; kvnumba serves "
                          f"latent layers of full attention")
    heads = config.num_attention_heads
    if heads % ranks:
        raise ConfigError(f"{config.model_type}: {heads} query heads cannot be split over "
                          f"{ranks} ranks (each rank attends whole heads over the latent)")
    modules = latent_modules(model)
    missing = [layer for layer in range(config.num_hidden_layers)
               if layer not in modules and layer not in states]
    if missing:
        raise ConfigError(f"{config.model_type}: kv_lora_rank is set, but decoder layers "
                          f"{missing} have no latent attention module (kv_a_layernorm, "
                          f"kv_b_proj)")
    refuse_modules(model, config.model_type)
    spec = latent(int(config.kv_lora_rank), int(config.qk_rope_head_dim))
    return [states.get(layer, spec) for layer in range(config.num_hidden_layers)]


def refuse_position_scales(config, capacity: int, max_step: int) -> None:
    """`ConfigError` where the model scales its queries by position from its own cache's
    length (Llama 4's `attn_temperature_tuning` on its layers without rotary positions:
    `1 + attn_scale * log1p(floor((p + 1) / floor_scale))`). Served with
    `use_cache=False`, the model takes a step's token index for p: the scales agree (all
    1) only while every position and every step's length stay below `floor_scale - 1`."""
    if not getattr(config, "attn_temperature_tuning", False):
        return
    if all(getattr(config, "no_rope_layers", None) or [1]):
        return                                   # every layer rotary: no scale applies
    scale = int(getattr(config, "floor_scale", 0) or 0)
    if max(capacity, max_step) >= scale:
        raise ConfigError(f"{config.model_type}: attn_temperature_tuning scales the queries "
                          f"of its layers without rotary positions by their position, "
                          f"which kvnumba serves exactly only below floor_scale={scale}: "
                          f"capacity={capacity} and max_step={max_step} must both be at "
                          f"most {scale - 1}")


def storage_dtype(model, dtype) -> str:
    """`dtype` if given (any `CacheConfig` dtype: "float8_e4m3" / "float8_e5m2" store K/V
    in 8-bit floats, scaled by `k_scale` / `v_scale`), else the model's own (float32,
    float16 or bfloat16)."""
    if dtype is not None:
        return dtype
    name = str(model.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"the model's dtype {name} has no kvnumba storage dtype; pass "
                          f"dtype='float32', 'float16' or 'bfloat16'")
    return _DTYPES[name]


def cache_config(model, *, max_seqs: int, capacity: int, max_write: int | None = None,
                 max_step: int | None = None, dtype: str | None = None,
                 tokens_per_decode: int = 1, **options) -> CacheConfig:
    """The `CacheConfig` that serves `model` (a `transformers` `PreTrainedModel`).

    Layers from `layer_types` / `sliding_window` (and `num_kv_shared_layers`: `shared`
    layers), each with its `num_key_value_heads` (for a model split over ranks by its
    tensor-parallel plan, this rank's share of them: `sharding`) and `head_dim` (else
    `hidden_size // num_attention_heads`), read per layer where the config holds them per
    layer; storage dtype from the model unless given. `max_write` (default `min(capacity, 256)`) and `max_step` (default
    `max_write + max_seqs * tokens_per_decode`: every sequence's decode beside one
    prompt chunk) as in `CacheConfig`; `options` go to it too (`page_size`,
    `initial_pages`, `max_pages`).
    `ConfigError` for a model with a stateful mixer kvnumba does not compute
    (`mixer_refusal`), whose attention does not go through `transformers`' attention
    interface or needs what kvnumba does not do, or whose heads its ranks cannot share
    (`kv_heads_per_rank`).
    """
    config = text_config(model.config)
    refuse_mixers(model, config)             # a mixer kvnumba does not compute: named first
    states = state_specs(model)
    # hybrid models' attention layers call the interface without declaring it (the
    # probe then checks every layer's output)
    if not getattr(model, "_supports_attention_backend", False) and not states:
        raise ConfigError(f"{config.model_type}: its attention does not go through "
                          f"transformers' AttentionInterface, so kvnumba cannot serve it")
    missing = unsupported(config)
    if missing:
        raise ConfigError(f"{config.model_type}: kvnumba does not compute {missing}")
    ranks = sharding(model).ranks
    if states and ranks > 1:
        raise ConfigError(f"{config.model_type}: its mixer layers {sorted(states)} keep "
                          f"states kvnumba does not split over {ranks} ranks; serve it "
                          f"on one")
    if getattr(config, "kv_lora_rank", None):
        specs = latent_specs(model, config, ranks, states)
        kv_heads = 1                                    # every layer sets its own shape
        head_dim = next(spec.v_head_dim for spec in specs if not spec.keeps_state)
    else:
        silent = set(range(config.num_hidden_layers)) - \
            set(model_layer_map(config, states).attention)
        shapes = layer_shapes(config, ranks, module_shapes(model), silent)
        specs = layer_specs(config, shapes, states)
        kv_heads, head_dim, _ = first_shape(shapes)
    # the defaults need ints; anything else goes on to CacheConfig, which names it
    if max_write is None:
        max_write = min(capacity, 256) if is_int(capacity) else capacity
    if max_step is None:
        max_step = (max_write + max_seqs * tokens_per_decode
                    if is_int(max_write) and is_int(max_seqs) else max_write)
    made = CacheConfig(layers=specs, n_kv_heads=kv_heads, head_dim=head_dim,
                       capacity=capacity, max_seqs=max_seqs, max_write=max_write,
                       max_step=max_step, dtype=storage_dtype(model, dtype), **options)
    refuse_position_scales(config, made.capacity, made.max_step)
    return made


def served_configs(model, draft_model, *, max_seqs: int, capacity: int, max_write, max_step,
                   dtype, draft_len: int, kv_bytes, **options) -> list:
    """The `CacheConfig` of each cache an engine makes: the model's (`tokens_per_decode`
    a decode and its `draft_len` drafts), then, with `draft_model`, the draft's (the
    model's `max_write` and `max_step`); with `kv_bytes`, fixed pools sharing it
    (`budgeted`). `ConfigError` where verifying a draft cannot fit `max_write` or the
    draft's vocabulary is not the model's."""
    config = cache_config(model, max_seqs=max_seqs, capacity=capacity, max_write=max_write,
                          max_step=max_step, dtype=dtype, tokens_per_decode=draft_len + 1,
                          **options)
    if config.max_write < draft_len + 1:
        raise ConfigError(f"max_write={config.max_write}: verifying a draft writes "
                          f"draft_len + 1 = {draft_len + 1} tokens of a request in "
                          f"one step; raise max_write or lower draft_len")
    vocab = text_config(model.config).vocab_size
    if draft_model is not None and text_config(draft_model.config).vocab_size != vocab:
        raise ConfigError(f"draft_model: vocabulary of "
                          f"{text_config(draft_model.config).vocab_size} tokens, the "
                          f"model's has {vocab}")
    configs = [config]
    if draft_model is not None:
        configs.append(cache_config(draft_model, max_seqs=max_seqs, capacity=capacity,
                                    max_write=config.max_write, max_step=config.max_step,
                                    dtype=dtype, **options))
    if kv_bytes is not None:
        configs = budgeted(configs, as_count(kv_bytes, "kv_bytes", 1))
    return configs


def budgeted(configs: list, kv_bytes: int) -> list:
    """`configs` made fixed pools sharing `kv_bytes` in proportion to their bytes per
    token (so each holds as many positions), a cache of state layers alone (no pool:
    `bytes_per_token` 0) left as it is; `ConfigError` when a share is too small for a
    pool, or when no cache has a pool to share it."""
    total = sum(config.bytes_per_token for config in configs)
    if not total:
        raise ConfigError(f"kv_bytes={kv_bytes}: every layer of the model is a state "
                          f"layer, so its cache has no K/V pages to size; leave kv_bytes "
                          f"out (its bytes are bytes_per_sequence "
                          f"{configs[0].bytes_per_sequence} a sequence slot)")
    return [config.fixed_pool(kv_bytes * config.bytes_per_token // total)
            if config.bytes_per_token else config for config in configs]


def refuse_dropout(model) -> None:
    """`ConfigError` for a model in training mode whose attention drops out: kvnumba
    attends without dropout, so it would compute another model."""
    dropout = getattr(text_config(model.config), "attention_dropout", 0.0) or 0.0
    if model.training and dropout:
        raise ConfigError(f"{model.config.model_type}: the model is in training mode with "
                          f"attention dropout {dropout}; kvnumba attends without dropout: "
                          f"put it in eval mode (model.eval())")
