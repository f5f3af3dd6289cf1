"""DeepSeek-V3 served from a latent cache (contract §16, `kvnumba.hf.latent`): every layer
a `kv.latent(kv_lora_rank, qk_rope_head_dim)`, its rows the module's own latents and
rotary keys, its attention in absorbed form; tiny random models built from
`transformers`' own config, against their own `generate()` (float32 storage, greedy),
and over 16-bit and fp8 storage against float32 storage's logits."""
import pytest

import kvnumba as kv

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hfmodels import STORAGE_TOLERANCE, SYSTEM, built, generated, kvhf, prefill_logits  # noqa: E402

#: two layers (one dense MLP, one of two experts), 4 heads over a latent of 32 and 8
#: rotary values; query and key heads of 16 + 8, values of 16
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             max_position_embeddings=64, kv_lora_rank=32, q_lora_rank=16,
             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=2,
             num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=1)


def deepseek(seed=0, **fields):
    return built("deepseek_v3", SHAPE, seed, **fields)


def test_deepseek_v3_is_served_token_for_token_from_its_latents():
    """The cache's layers are latent (32 + 8 values a token: 40 x 4 bytes a layer, not
    the expanded 4 heads x (24 + 16)); greedy tokens equal `generate()` with a hit on
    the shared 8 tokens, two forks and a DeepSeek-V3 draft."""
    model, draft = deepseek(), deepseek(seed=1, num_hidden_layers=1)
    prompts = [SYSTEM[:9] + [11, 12], SYSTEM[:9] + [13, 14, 15]]
    want = [generated(model, p, 3) for p in prompts]
    engine = kvhf.Engine(model, max_seqs=2, capacity=32, max_write=8, dtype="float32",
                         page_size=8, draft_model=draft, draft_len=2)
    config = engine.target.cache.config
    assert config.layers == (kv.latent(32, 8),) * 2
    assert config.bytes_per_token == 2 * 40 * 4
    assert engine.generate(prompts[:1], max_new_tokens=3) == want[:1]
    assert engine.generate(prompts[1:], max_new_tokens=2, n=2) == [want[1][:2]] * 2
    assert engine.stats.cached_tokens == 8


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3", "float8_e5m2"])
def test_deepseek_v3_over_16_bit_and_fp8_storage_stays_near_float32(dtype):
    """A 17-token prefill: every logit within the storage's tolerance of float32
    storage's (the rows rounded to it)."""
    model = deepseek()
    got = prefill_logits(model, dtype, SYSTEM)
    want = prefill_logits(model, "float32", SYSTEM)
    torch.testing.assert_close(got, want, rtol=0, atol=STORAGE_TOLERANCE[dtype])


def test_indexed_sparse_attention_is_refused_naming_it():
    """DeepSeek-V3.2's layers select their keys with an indexer: refused at
    construction, naming the layer type."""
    model = built("deepseek_v32", SHAPE, index_n_heads=2, index_head_dim=16, index_topk=4)
    with pytest.raises(kv.ConfigError, match=r"deepseek_v32: kvnumba does not compute "
                                             r"'indexed_attention' layers"):
        kvhf.Engine(model, max_seqs=1, capacity=16)
