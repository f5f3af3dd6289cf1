"""Llama 4 text served through chunked layers (contract §15): its `chunked_attention`
layers see their own chunk of `attention_chunk_size` positions, its full layers every
position; a tiny random model built from `transformers`' own config, against its own
`generate()` (float32 storage, greedy)."""
import pytest

import kvnumba as kv

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hfmodels import (STORAGE_TOLERANCE, SYSTEM, built, generated, kvhf,  # noqa: E402
                      prefill_logits)
from kvnumba.hf.probe import TOLERANCE  # noqa: E402

#: two layers: a chunked one (chunks of 4, so every prompt crosses several) with rotary
#: positions and a full one without (Llama 4's NoPE layer); two experts
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64, attention_chunk_size=4, no_rope_layer_interval=2,
             num_local_experts=2, num_experts_per_tok=1)


def llama4(seed=0, **fields):
    return built("llama4_text", SHAPE, seed, **fields)


def test_llama4_text_is_served_token_for_token_with_prefix_hits_forks_and_a_draft():
    """The cache's layers follow `layer_types`; greedy tokens equal `generate()` with a
    hit on the shared 8 tokens, two forks and a Llama 4 draft; and the chunks matter:
    the same weights with chunks of 64 move the model's own logits by more than the
    probe's float32 tolerance."""
    model, draft = llama4(), llama4(seed=1)
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    prompts = [SYSTEM[:9] + [11, 12], SYSTEM[:9] + [13, 14, 15]]
    want = [generated(model, p, 3) for p in prompts]
    engine = kvhf.Engine(model, max_seqs=2, capacity=32, max_write=8, dtype="float32",
                         page_size=8, draft_model=draft, draft_len=2)
    assert engine.target.cache.config.layers == (kv.chunked(4), kv.flat())
    assert engine.generate(prompts[:1], max_new_tokens=3) == want[:1]
    assert engine.generate(prompts[1:], max_new_tokens=2, n=2) == [want[1][:2]] * 2
    assert engine.stats.cached_tokens == 8
    unchunked = llama4(attention_chunk_size=64)
    unchunked.load_state_dict(model.state_dict())
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        moved = (model(ids).logits - unchunked(ids).logits).abs().max().item()
    assert moved > 20 * TOLERANCE["float32"]


def test_a_query_scale_by_position_past_floor_scale_is_refused_naming_the_bound():
    """Llama 4's temperature tuning scales its NoPE layers' queries by position: served
    below `floor_scale` (scales all 1) or with it off; past it, refused at construction
    naming the bound and both limits."""
    model = llama4(floor_scale=32)
    with pytest.raises(kv.ConfigError, match=r"llama4_text: attn_temperature_tuning .* "
                                             r"floor_scale=32: capacity=32 and max_step="
                                             r"\d+ must both be at most 31"):
        kvhf.Engine(model, max_seqs=1, capacity=32, dtype="float32")
    engine = kvhf.Engine(model, max_seqs=1, capacity=24, dtype="float32")
    assert engine.generate([SYSTEM], max_new_tokens=2) == [generated(model, SYSTEM, 2)]
    untuned = llama4(floor_scale=32, attn_temperature_tuning=False)
    assert kvhf.Engine(untuned, max_seqs=1, capacity=32, dtype="float32").generate(
        [SYSTEM], max_new_tokens=2) == [generated(untuned, SYSTEM, 2)]


def test_chunked_layers_without_a_chunk_size_are_refused():
    model = llama4()
    model.config.attention_chunk_size = None
    with pytest.raises(kv.ConfigError, match="chunked_attention layers without an "
                                             "attention_chunk_size"):
        kvhf.cache_config(model, max_seqs=1, capacity=16)


@pytest.mark.parametrize("dtypes", [("bfloat16", "float8_e4m3"), ("float16", "float8_e5m2")])
def test_llama4_over_16_bit_and_fp8_storage_stays_near_float32(dtypes):
    """A 17-token prefill of the chunked model with 16-bit and 8-bit float K/V: every
    logit within its storage's tolerance of float32 storage's (measured: bfloat16 5e-4,
    float16 1e-4, e4m3 0.007, e5m2 0.017), and the fp8 run quantised (not equal)."""
    model = llama4()
    want = prefill_logits(model, "float32", SYSTEM)
    assert want.abs().max() > 0.1
    for dtype in dtypes:
        got = prefill_logits(model, dtype, SYSTEM)
        torch.testing.assert_close(got, want, rtol=0, atol=STORAGE_TOLERANCE[dtype])
    assert not torch.equal(got, want)
