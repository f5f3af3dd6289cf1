"""Families whose layers differ from the common `[batch, T, hidden]` decoder: tiny random
models built from `transformers`' own configs, each served token for token against its
own `generate()` (float32 storage, greedy, the probe on) or refused at construction
with a `ConfigError` naming what kvnumba does not compute."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvnumba as kv  # noqa: E402
from hfmodels import built, generated, kvhf  # noqa: E402
from kvnumba.hf.probe import joined  # noqa: E402

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def served_as_generated(model, new=3):
    """Greedy tokens through an engine (probe on) equal `generate()`'s; the engine."""
    want = generated(model, PROMPT, new)
    engine = kvhf.Engine(model, max_seqs=1, capacity=24, dtype="float32")
    assert engine.generate([PROMPT], max_new_tokens=new) == [want]
    return engine


def test_gemma3n_text_layers_of_four_altup_streams_pass_the_probe_and_are_served():
    """Gemma 3n's decoder layers return `[4, batch, T, hidden]` (AltUp streams): the probe
    joins kvnumba's two steps along the token dimension and compares every stream; the
    second layer reads the first's K/V (`num_kv_shared_layers`)."""
    model = built("gemma3n_text", SHAPE, num_kv_shared_layers=1, sliding_window=4,
                  vocab_size_per_layer_input=64, hidden_size_per_layer_input=8,
                  laurel_rank=4)
    engine = served_as_generated(model)
    assert engine.target.cache.config.layers == (kv.ring(4), kv.shared(0))


def test_a_layer_output_the_probe_cannot_join_is_refused_naming_its_shapes():
    steps = (torch.zeros(1, 6, 8), torch.zeros(2, 1, 8))
    with pytest.raises(kv.ConfigError, match=r"layer 3's output cannot be compared.*"
                                             r"\[1, 6, 8\].*\[2, 1, 8\].*\[1, 7, 8\]"):
        joined("m", 3, steps, torch.zeros(1, 7, 8))
    assert joined("m", 0, (torch.zeros(4, 1, 6, 8), torch.ones(4, 1, 1, 8)),
                  torch.zeros(4, 1, 7, 8))[:, :, 6].eq(1).all()


def test_laguna_query_heads_varying_by_layer_are_read_from_its_modules():
    """Laguna's `num_attention_heads_per_layer` (4 then 8 query heads over 2 kv heads):
    each layer's kv heads are its module's query heads over its kv groups, not the
    config's global head count over them (layer 1 would hold 1 kv head of its 2)."""
    model = built("laguna", SHAPE, num_attention_heads_per_layer=[4, 8], num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16,
                  shared_expert_intermediate_size=16, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"])
    engine = served_as_generated(model)
    assert [shape.n_kv_heads for shape in engine.target.cache.config.layer_shapes] == [2, 2]


def test_a_model_with_no_query_head_count_is_refused_naming_it():
    """Neither its config nor its attention modules give `num_attention_heads`: a
    `ConfigError` at construction, not a `TypeError` from the arithmetic on it."""
    model = built("llama", SHAPE)
    object.__setattr__(model.config, "num_attention_heads", None)   # past its validation
    with pytest.raises(kv.ConfigError, match="layer 0's query head count is None "
                                             r"\(num_attention_heads"):
        kvhf.Engine(model, max_seqs=1, capacity=24, dtype="float32")


def test_longcat_flash_latents_are_kept_with_the_modules_scale():
    """LongCat-Flash multiplies its latent by `mla_scale_kv_lora` after `kv_a_layernorm`:
    the latents kept are the scaled ones (unscaled, the probe refuses layer 0, off by a
    third of its largest value). One decoder layer of two latent attention sublayers."""
    shape = {name: value for name, value in SHAPE.items()
             if name not in ("head_dim", "num_key_value_heads")}
    model = built("longcat_flash", shape, num_key_value_heads=4, n_routed_experts=4,
                  moe_topk=2, zero_expert_num=2, expert_ffn_hidden_size=16, kv_lora_rank=8,
                  q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                  qk_head_dim=16, head_dim=8)
    assert model.model.layers[0].self_attn[0].mla_scale_kv_lora == 2.0
    engine = served_as_generated(model)
    assert [spec.latent for spec in engine.target.cache.config.layers] == [True, True]
