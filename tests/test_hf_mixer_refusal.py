"""Hybrid models whose layers mix tokens through a recurrent state kvnumba does not
compute (gated delta nets, short convolutions, Mamba mixers, RG-LRU blocks) are refused
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
#: small Mamba-2 mixers (their heads times head dim twice the hidden size)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)
#: model type -> (its fields: a mixer layer, then an attention layer; the refusal's
#: message)
HYBRIDS = {
    "qwen3_next": (dict(layer_types=["linear_attention", "full_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16),
                   r"qwen3_next: layer 0 is a 'linear_attention' layer "
                   r"\(Qwen3NextGatedDeltaNet\): kvnumba does not compute this mixer.*"
                   r"mixer layers \[0\] of 2"),
    "lfm2": (dict(layer_types=["conv", "full_attention"]),
             r"lfm2: layer 0 is a 'conv' layer \(Lfm2ShortConv\): kvnumba does not compute "
             r"this mixer"),
    "bamba": (dict(attn_layer_indices=[1], **MAMBA2),
              r"bamba: layer 0 is a 'linear_attention' layer \(BambaMixer\): kvnumba does "
              r"not compute this mixer"),
    "granitemoehybrid": (dict(layer_types=["linear_attention", "full_attention"], **MAMBA2),
                         r"granitemoehybrid: layer 0 is a 'linear_attention' layer "
                         r"\(GraniteMoeHybridMambaLayer\): kvnumba does not compute this "
                         r"mixer"),
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
    `Attention`): only its delta attention layers are named."""
    model = built("kimi_linear", SHAPE, num_hidden_layers=2,
                  layer_types=["linear_attention", "full_attention"],
                  mlp_layer_types=["dense", "dense"], pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    assert mixer_refusal.stateful_mixers(model) == [(0, "KimiLinearDeltaAttention")]


def test_an_attention_model_has_no_mixer():
    assert mixer_refusal.stateful_mixers(built("llama", SHAPE)) == []


def test_a_mixer_kvnumba_computes_is_not_refused(monkeypatch):
    """A class in `COMPUTED` is left to the checks after it (here: the layer type)."""
    fields, _ = HYBRIDS["lfm2"]
    model = built("lfm2", SHAPE, **fields)
    monkeypatch.setattr(mixer_refusal, "COMPUTED", {"Lfm2ShortConv"})
    assert mixer_refusal.stateful_mixers(model) == []
    with pytest.raises(kv.ConfigError, match="lfm2: kvnumba does not compute 'conv' layers"):
        kvhf.Engine(model, max_seqs=1, capacity=24, dtype="float32")
