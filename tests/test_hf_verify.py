"""Accepted means exact: what `kvnumba.hf` reads of a model's modules, and the probe that
compares a model's own attention with kvnumba's before an engine serves it (tiny random
models; float32 storage)."""
import os

import pytest

import kvnumba as kv

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hfmodels import (PROMPTS, STORAGE_TOLERANCE, SYSTEM, built, generated,  # noqa: E402
                      kvhf, prefill_logits, tiny)
from kvnumba.hf.probe import TOLERANCE  # noqa: E402

from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64)


def halved_values(module, query, key, value, attention_mask, **kwargs):
    """An attention that is not the one kvnumba computes: the usual one over V / 2."""
    return sdpa_attention_forward(module, query, key, value / 2, attention_mask, **kwargs)


#: the sink models' shape: two layers (a sliding one of window 4, shorter than the shared
#: prompt part, and a full one), gpt-oss's experts few
SINK_MODELS = {"gpt_oss": dict(num_hidden_layers=2, sliding_window=4, num_local_experts=4,
                               num_experts_per_tok=2),
               "granite_swa": dict(num_hidden_layers=2, sliding_window=4)}


def sink_model(model_type, seed=0):
    """A tiny random `model_type` whose learned sinks are about the size of its scores
    (initialised near zero, a sink served wrong would hardly show)."""
    torch.manual_seed(seed)
    model = built(model_type, SMALL, **SINK_MODELS[model_type])
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "sinks", None) is not None:
                module.sinks.copy_(2 * torch.randn_like(module.sinks))
    return model


@pytest.mark.parametrize("model_type", sorted(SINK_MODELS) if THOROUGH else ["gpt_oss"])
def test_models_with_learned_sinks_are_served_token_for_token(model_type):
    """gpt-oss and granite_swa pass their layers' sinks as `s_aux`: they pass the probe
    and are served as `generate()` (greedy, float32 storage) with the prefix cache
    hitting, forks and a draft of the same family (the probe has compared every layer's
    output first); and their sinks matter: with its sinks at -inf the model's own logits
    move by more than the probe's float32 tolerance. Granite-SWA, of gpt-oss's layout
    (sinks on a sliding and a full layer), under the thorough profile."""
    model, draft = sink_model(model_type), sink_model(model_type, seed=1)
    prompts = [SYSTEM + [11, 12], SYSTEM + [13, 14, 15]]
    want = [generated(model, p, 3) for p in prompts]
    engine = kvhf.Engine(model, max_seqs=2, capacity=32, max_write=8, dtype="float32",
                         page_size=8, draft_model=draft, draft_len=2)
    assert engine.generate(prompts[:1], max_new_tokens=3) == want[:1]
    assert engine.generate(prompts[1:], max_new_tokens=2, n=2) == [want[1][:2]] * 2
    assert engine.stats.cached_tokens == 16
    sinkless = sink_model(model_type)
    with torch.no_grad():
        for module in sinkless.modules():
            if getattr(module, "sinks", None) is not None:
                module.sinks.fill_(-float("inf"))
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        moved = (model(ids).logits - sinkless(ids).logits).abs().max().item()
    assert moved > 20 * TOLERANCE["float32"]


def test_gpt_oss_over_16_bit_and_fp8_storage_stays_near_float32():
    """A 17-token prefill of gpt-oss (sinks on a sliding and a full layer) with float16 and
    e5m2 K/V: every logit within its storage's tolerance of float32 storage's (measured:
    float16 below 1e-4, e5m2 0.013), the fp8 run quantised (not equal)."""
    model = sink_model("gpt_oss")
    want = prefill_logits(model, "float32", SYSTEM)
    assert want.abs().max() > 0.1
    for dtype in ("float16", "float8_e5m2"):
        got = prefill_logits(model, dtype, SYSTEM)
        torch.testing.assert_close(got, want, rtol=0, atol=STORAGE_TOLERANCE[dtype])
    assert not torch.equal(got, want)


def test_the_probe_refuses_an_attention_kvnumba_does_not_compute():
    """A model whose own attention is not kvnumba's (its values halved, passed as no
    argument kvnumba could see) is refused at construction, naming the first layer
    that differs and by how much (the greedy tokens of a one-layer model may still
    agree: the probe compares the layers' outputs); `verify=False` serves it anyway."""
    AttentionInterface.register("halved_values", halved_values)
    model = tiny("llama")
    model.config._attn_implementation = "halved_values"
    with pytest.raises(kv.ConfigError, match=r"llama: through kvnumba, decoder layer 0's "
                                             r"output differs from the model's own by "
                                             r".*float32 storage allows 0.001"):
        kvhf.Engine(model, max_seqs=1, capacity=16, dtype="float32")
    engine = kvhf.Engine(model, max_seqs=1, capacity=16, dtype="float32", verify=False)
    assert len(engine.generate([PROMPTS[1]], max_new_tokens=3)[0]) == 3


def test_a_model_whose_own_forward_raises_is_refused_naming_it():
    """The probe runs the model on its own first: an error of the model itself is a
    `ConfigError` naming the model type, its own forward and the error's first line,
    chained to it."""
    model = tiny("llama")

    def broken(*args, **kwargs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied\nsecond line")
    model.forward = broken
    with pytest.raises(kv.ConfigError, match=r"llama: the model's own forward failed .*"
                                             r"RuntimeError: mat1 and mat2 shapes cannot be "
                                             r"multiplied\).*model\(input_ids\).*"
                                             r"verify=False does not help") as caught:
        kvhf.Engine(model, max_seqs=1, capacity=16, dtype="float32")
    assert "second line" not in str(caught.value)
    assert isinstance(caught.value.__cause__, RuntimeError)


#: BERT's shape: no kv-head count or head dim of its own (hidden_size / heads)
BERT = {name: value for name, value in SMALL.items()
        if name not in ("num_key_value_heads", "head_dim")}


def test_the_probe_refuses_bidirectional_attention():
    """BERT as a causal LM attends both ways (`is_decoder` unset): the probe names its
    first layer; set as a decoder it attends causally, passes the probe and is served
    token for token."""
    model = built("bert", BERT)
    with pytest.raises(kv.ConfigError, match=r"bert: through kvnumba, decoder layer 0's"):
        kvhf.Engine(model, max_seqs=1, capacity=16, dtype="float32")
    decoder = built("bert", BERT, is_decoder=True)
    engine = kvhf.Engine(decoder, max_seqs=1, capacity=16, dtype="float32")
    assert engine.generate([PROMPTS[1]], max_new_tokens=3) == [generated(decoder, PROMPTS[1], 3)]


def test_a_model_whose_config_misstates_its_attention_shape_is_refused_at_construction():
    """A config whose `head_dim` and `num_key_value_heads` are not what its modules use
    (BERT's are hidden_size / heads, whatever the config says): the probe's step meets
    K of another shape and the engine is refused at construction, naming it, instead of
    failing at its first step."""
    model = built("bert", SMALL, is_decoder=True)
    with pytest.raises(kv.ConfigError, match=r"bert: kvnumba cannot serve it exactly \(its "
                                             r"probe step .*k: expected shape \(6, 2, 16\), "
                                             r"got \(6, 4, 8\)"):
        kvhf.Engine(model, max_seqs=1, capacity=16, dtype="float32")


def test_a_served_model_passes_the_probe_and_its_engine_starts_empty():
    """The probe runs on a cache of its own: a model it passes (and its draft) is served
    token for token, the engine's caches holding nothing before the first request."""
    model, draft = tiny("llama"), tiny("llama", seed=1)
    engine = kvhf.Engine(model, max_seqs=2, capacity=16, dtype="float32", draft_model=draft,
                         draft_len=2)
    for served in (engine.target, engine.draft):
        cache = served.cache
        assert all(cache.state(s) == kv.SlotState.FREE for s in range(cache.max_seqs))
        assert all(cache.pos(s) == 0 for s in range(cache.max_seqs))
        assert served.table.sessions == ()
    assert engine.generate([PROMPTS[0]], max_new_tokens=3) == [generated(model, PROMPTS[0], 3)]


def test_verify_takes_a_bool():
    with pytest.raises(kv.ConfigError, match=r"verify='yes': pass True or False"):
        kvhf.Engine(tiny("llama"), max_seqs=1, capacity=8, verify="yes")


