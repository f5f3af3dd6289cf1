"""MiMo-V2-Flash served with the shapes its attention modules hold (contract §15): its
sliding layers hold twice the config's kv heads and learned sinks, and every layer's V
heads are narrower than its K heads (`v_head_dim` 128 beside a head dim of 16 here), so
the cache's layers take their shapes from the modules, not from the config's single
`num_key_value_heads`; a tiny random model from `transformers`' own config, against its
own `generate()` (float32 storage, greedy)."""
import pytest

import kvnumba as kv

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hfmodels import SYSTEM, built, generated, kvhf  # noqa: E402

#: a full layer, then two sliding ones (window 4); V heads of 24 beside K heads of 16
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
             v_head_dim=24, max_position_embeddings=64, sliding_window=4,
             layer_types=["full_attention", "sliding_attention", "sliding_attention"],
             mlp_layer_types=["dense", "dense", "dense"])


def mimo(seed=0):
    model = built("mimo_v2_flash", SHAPE, seed)
    with torch.no_grad():               # learned sinks of their own, not the init's zeros
        for layer in model.model.layers:
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.normal_(0, 2)
    return model


def test_mimo_is_served_token_for_token_with_its_modules_shapes():
    """The full layer holds 1 kv head, the sliding ones 2 (the module's
    `num_key_value_groups`), all with V of 24 beside K of 16; greedy tokens equal
    `generate()` with a prefix hit on 8 shared tokens and two forks."""
    model = mimo()
    prompts = [SYSTEM[:9] + [11, 12], SYSTEM[:9] + [13, 14, 15]]
    want = [generated(model, p, 3) for p in prompts]
    engine = kvhf.Engine(model, max_seqs=2, capacity=24, max_write=8, dtype="float32",
                         page_size=8)
    config = engine.target.cache.config
    assert (config.n_kv_heads, config.head_dim) == (1, 16)
    assert config.layers == (kv.flat(v_head_dim=24), kv.ring(4, n_kv_heads=2, v_head_dim=24),
                             kv.ring(4, n_kv_heads=2, v_head_dim=24))
    assert config.bytes_per_token == 4 * (1 * 40 + 2 * 2 * 40)
    assert engine.generate(prompts[:1], max_new_tokens=3) == want[:1]
    assert engine.generate(prompts[1:], max_new_tokens=3, n=2) == [want[1]] * 2
    assert engine.stats.cached_tokens == 8
