"""Gemma 4 text served with its own shapes (contract §15): sliding layers of one head dim
and kv-head count, full layers of another (`global_head_dim`, `num_global_key_value_heads`
with `attention_k_eq_v`: V from K's projection), and its last layers reading the K/V of
the last earlier layer of their type (`num_kv_shared_layers`) from storage they do not
hold; tiny random models built from `transformers`' own config, against their own
`generate()` (float32 storage, greedy)."""
import pytest

import kvnumba as kv

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hfmodels import (STORAGE_TOLERANCE, SYSTEM, built, generated, kvhf,  # noqa: E402
                      prefill_logits)

#: four layers, sliding (window 4, head dim 16, 2 kv heads) and full (head dim 32, 1 kv
#: head, V = K's projection) in turn; the last two read layers 0 and 1's K/V
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64, vocab_size_per_layer_input=64,
             hidden_size_per_layer_input=8, sliding_window=4,
             layer_types=["sliding_attention", "full_attention"] * 2, global_head_dim=32,
             num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2)


def gemma4(seed=0, **fields):
    return built("gemma4_text", SHAPE, seed, **fields)


def test_gemma4_text_is_served_token_for_token_with_prefix_hits_forks_and_a_draft():
    """The cache's layers follow the config per layer: a ring of head dim 16 and 2 kv
    heads, a flat layer of head dim 32 and 1 kv head, and two shared layers; greedy
    tokens equal `generate()` with a hit on the shared 8 tokens, two forks and a Gemma 4
    draft (two layers, without shared ones); the shared layers add no bytes."""
    model = gemma4()
    draft = gemma4(seed=1, num_kv_shared_layers=0, num_hidden_layers=2,
                   layer_types=["sliding_attention", "full_attention"])
    assert model.config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    prompts = [SYSTEM[:9] + [11, 12], SYSTEM[:9] + [13, 14, 15]]
    want = [generated(model, p, 3) for p in prompts]
    engine = kvhf.Engine(model, max_seqs=2, capacity=32, max_write=8, dtype="float32",
                         page_size=8, draft_model=draft, draft_len=2)
    config = engine.target.cache.config
    assert (config.n_kv_heads, config.head_dim) == (2, 16)
    assert config.layers == (kv.ring(4), kv.flat(n_kv_heads=1, head_dim=32), kv.shared(0),
                             kv.shared(1))
    assert config.bytes_per_token == 4 * (2 * 2 * 16 + 1 * 2 * 32)
    assert engine.generate(prompts[:1], max_new_tokens=3) == want[:1]
    assert engine.generate(prompts[1:], max_new_tokens=2, n=2) == [want[1][:2]] * 2
    assert engine.stats.cached_tokens == 8


def test_gemma4_full_layers_of_head_dim_512_are_served_on_the_generic_kernel():
    """The released global head dim, 512, beside sliding layers of 16 (one token of
    prompt past a page, two new tokens)."""
    model = gemma4(global_head_dim=512, num_kv_shared_layers=0, num_hidden_layers=2,
                   layer_types=["sliding_attention", "full_attention"])
    engine = kvhf.Engine(model, max_seqs=1, capacity=16, dtype="float32", page_size=8)
    assert engine.target.cache.config.layer_shapes[1] == kv.LayerShape(1, 512, 512)
    assert engine.generate([SYSTEM[:9]], max_new_tokens=2) == [generated(model, SYSTEM[:9], 2)]


def test_a_model_whose_layers_all_read_k_v_from_outside_it_is_refused():
    model = gemma4(num_kv_shared_layers=4)
    with pytest.raises(kv.ConfigError, match=r"gemma4_text: kvnumba does not compute layers "
                                             r"that all attend over K/V from outside the model "
                                             r"\(num_kv_shared_layers=4 of 4\)"):
        kvhf.Engine(model, max_seqs=1, capacity=16)


def quantised_reference(fmt: str):
    """The name of an attention registered with `transformers`: its own SDPA over K and V
    rounded to `fmt` ("float8_e4m3" / "float8_e5m2") by ml_dtypes (round to nearest even,
    once), with SDPA's masks: the model kvnumba's fp8 storage computes, up to its 16-bit
    arithmetic."""
    import ml_dtypes
    import numpy as np
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    held = {"float8_e4m3": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}[fmt]

    def rounded(x):
        return torch.from_numpy(x.detach().numpy().astype(held).astype(np.float32))

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, rounded(key), rounded(value),
                                      attention_mask, **kwargs)

    name = f"sdpa_over_{fmt}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3", "float8_e5m2"])
def test_gemma4_over_16_bit_and_fp8_storage(dtype):
    """A 17-token prefill: over 16-bit K/V every logit within its storage's tolerance of
    float32 storage's (measured: bfloat16 0.004, float16 5e-4); over fp8, within 0.03 of
    the model's own attention over K/V rounded to that format (measured: e4m3 2e-4, e5m2
    0.012). Gemma 4's scores are unscaled dot products of normed heads (scale 1), so
    fp8's own rounding moves this model's logits far more than Llama's (e4m3 0.058,
    e5m2 0.22 from float32 storage's): the quantised model is the reference."""
    model = gemma4()
    got = prefill_logits(model, dtype, SYSTEM)
    if not dtype.startswith("float8"):
        want = prefill_logits(model, "float32", SYSTEM)
        torch.testing.assert_close(got, want, rtol=0, atol=STORAGE_TOLERANCE[dtype])
        return
    reference = gemma4()
    reference.set_attn_implementation(quantised_reference(dtype))
    with torch.no_grad():
        want = reference(torch.tensor([SYSTEM])).logits[0]
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=0.03)
