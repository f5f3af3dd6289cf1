"""Hybrid models whose layers mix tokens through a recurrent state kvnumba does not
compute (RG-LRU blocks; the mixers it computes are `kvnumba.hf.mixers`') are refused
at construction with a `ConfigError` naming each such layer's type and mixer class
(`kvnumba.hf.mixer_refusal`), before any other check: their attention layers do go
through `transformers`' AttentionInterface. Tiny random models from `transformers`'
own configs, each holding a mixer layer beside an attention layer; no probe runs."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvnumba as kv  # noqa: E402
from hfmodels import built, kvhf  # noqa: E402
from kvnumba.hf import mixer_refusal  # noqa: E402

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64)
#: model type -> (its fields: a mixer layer, then an attention layer; the refusal's
#: message)
HYBRIDS = {
    "recurrent_gemma": (dict(num_hidden_layers=3, block_types=["recurrent", "recurrent",
                                                               "attention"],
                             lru_width=32, attention_window_size=8),
                        r"recurrent_gemma: layer 0 is a 'linear_attention' layer "
                        r"\(RecurrentGemmaRecurrentBlock\): kvnumba does not compute this "
                        r"mixer.*mixer layers \[0, 1\] of 3"),
}


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_a_hybrid_is_refused_naming_its_mixer_layers(model_type):
    """The engine and `cache_config` refuse it naming layer 0's type and mixer class
    (not the AttentionInterface: its attention layer goes through it)."""
    fields, message = HYBRIDS[model_type]
    layers = fields.get("num_hidden_layers", SHAPE["num_hidden_layers"])
    model = built(model_type, {**SHAPE, "num_hidden_layers": layers},
                  **{name: value for name, value in fields.items()
                     if name != "num_hidden_layers"})
    assert mixer_refusal.stateful_mixers(model)[0][0] == 0
    with pytest.raises(kv.ConfigError, match=message) as refused:
        kvhf.Engine(model, max_seqs=1, capacity=24, dtype="float32")
    assert "does not go through" not in str(refused.value)
    with pytest.raises(kv.ConfigError, match=message):
        kvhf.cache_config(model, max_seqs=1, capacity=24)


def test_attention_named_like_a_mixer_is_not_one():
    """Kimi-Linear's full attention is `KimiLinearAttention` (its family's prefix, then
    `Attention`): only its delta attention is a mixer (one kvnumba computes)."""
    assert not mixer_refusal.is_mixer("KimiLinearAttention", "KimiLinear")
    assert mixer_refusal.is_mixer("KimiLinearDeltaAttention", "KimiLinear")
    model = built("kimi_linear", SHAPE, num_hidden_layers=2,
                  layer_types=["linear_attention", "full_attention"],
                  mlp_layer_types=["dense", "dense"], pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    assert mixer_refusal.stateful_mixers(model) == []


def test_an_attention_model_has_no_mixer():
    assert mixer_refusal.stateful_mixers(built("llama", SHAPE)) == []


def test_a_mixer_kvnumba_computes_is_not_refused():
    """The classes of `kvnumba.hf.mixers` are served on state layers, not refused."""
    model = built("lfm2", SHAPE, layer_types=["conv", "full_attention"])
    assert mixer_refusal.stateful_mixers(model) == []
    config = kvhf.cache_config(model, max_seqs=1, capacity=24)
    assert [spec.keeps_state for spec in config.layers] == [True, False]
