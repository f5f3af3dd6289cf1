"""`kvnumba.hf.mixers`: each hybrid family's mixer computed through the state ops equals
the `transformers` module's own output. Tiny random models built from `transformers`'
own configs (float32, eval), the ops the float64 token-by-token reference of
`mixerref.py`: one shot, split into chunks (the state carried between calls), and packed
with another sequence (each sequence's output as alone)."""
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mixerref import RefOps  # noqa: E402

import kvnumba as kv  # noqa: E402
from kvnumba.hf import mixers  # noqa: E402

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
SPECIAL = dict(vocab_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2)
COMMON = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, **SPECIAL)
LINEAR4 = ["linear_attention"] * 3 + ["full_attention"]
#: Hk=2 key heads of 8 serving Hv=4 value heads of 16 (grouped value heads)
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=16, linear_conv_kernel_dim=4, head_dim=8,
           num_hidden_layers=4, layer_types=LINEAR4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=16)
MLA = dict(num_hidden_layers=4, layer_types=LINEAR4, num_key_value_heads=4,
           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
           num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
#: Mamba2: 4 heads of P=16 in 2 groups of state N=8 (d_inner 64; conv over 64 + 2*2*8
#: channels), `transformers`' scan in chunks of 64 (the one-shot test crosses one)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2,
              mamba_expand=2, mamba_chunk_size=64)
SSD = ((96, 4), (4, 16, 8))
GRANITE = dict(MAMBA2, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba",
                                                         "mamba"],
               num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16)
#: Nemotron-H's pattern: mamba, mlp, mamba, attention, moe, mamba
NEMOTRON = dict(hybrid_override_pattern="M-M*EM", mamba_num_heads=4, mamba_head_dim=16,
                ssm_state_size=8, n_groups=2, chunk_size=64, head_dim=8,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                moe_shared_expert_intermediate_size=16)
#: Zamba2: a mamba mixer in every layer, the shared attention block in the "hybrid" one
ZAMBA2 = dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"],
              n_mamba_heads=4, mamba_headdim=16, mamba_d_state=8, mamba_ngroups=2,
              mamba_expand=2, chunk_size=64)
#: Falcon-H1: attention and mamba side by side in every layer, its muP multipliers set
FALCON = dict(MAMBA2, num_hidden_layers=3, mamba_d_ssm=64, head_dim=8,
              ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.8], ssm_in_multiplier=0.6)
#: Mamba-2 alone: three mixer layers, no attention
PURE_MAMBA2 = dict(num_hidden_layers=3, num_heads=4, head_dim=16, state_size=8, n_groups=2,
                   expand=2, chunk_size=64)
#: Jamba: Mamba1 mixers (d_inner 64, state 8) in three of four layers, attention in one
JAMBA = dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1, mamba_d_state=8,
             mamba_expand=2, num_experts=1)
#: Mamba and Falcon-Mamba: three Mamba1 mixer layers alone (d_inner 64, state 8)
MAMBA1 = dict(num_hidden_layers=3, state_size=8, expand=2)
#: model type -> (config fields, mixer class, (conv, recurrent) state per mixer layer)
FAMILIES = {
    "qwen3_next": ({**GDN, **MOE}, "Qwen3NextGatedDeltaNet", ((96, 4), (4, 8, 16))),
    "qwen3_5_text": (GDN, "Qwen3_5GatedDeltaNet", ((96, 4), (4, 8, 16))),
    "qwen3_5_moe_text": ({**GDN, **MOE}, "Qwen3_5MoeGatedDeltaNet", ((96, 4), (4, 8, 16))),
    "olmo_hybrid": ({**GDN, "head_dim": None}, "OlmoHybridGatedDeltaNet",
                    ((96, 4), (4, 8, 16))),
    "olmo_hybrid-posbeta": ({**GDN, "head_dim": None, "linear_allow_neg_eigval": False},
                            "OlmoHybridGatedDeltaNet", ((96, 4), (4, 8, 16))),
    "kimi_linear": ({**MLA, "linear_head_dim": 8, "linear_num_heads": 4,
                     "linear_conv_kernel_dim": 4}, "KimiLinearDeltaAttention",
                    ((96, 4), (4, 8, 8))),
    "bailing_hybrid": ({**MLA, "head_dim": 8, "short_conv_kernel_size": 4, "n_group": 1,
                        "topk_group": 1, "first_k_dense_replace": 1},
                       "BailingHybridDeltaAttention", ((96, 4), (4, 8, 8))),
    "bailing_hybrid-softplus": ({**MLA, "head_dim": 8, "short_conv_kernel_size": 4,
                                 "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                                 "kda_safe_gate": False},
                                "BailingHybridDeltaAttention", ((96, 4), (4, 8, 8))),
    "lfm2": (dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]),
             "Lfm2ShortConv", ((32, 3), None)),
    "lfm2-bias": (dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                       conv_bias=True), "Lfm2ShortConv", ((32, 3), None)),
    "lfm2_moe": (dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      num_dense_layers=1), "Lfm2MoeShortConv", ((32, 3), None)),
    "lfm3": (dict(num_hidden_layers=4, sliding_window=4,
                  layer_types=["conv", "sliding_attention", "full_attention", "conv"]),
             "Lfm3ShortConv", ((32, 7), None)),
    "granitemoehybrid": (GRANITE, "GraniteMoeHybridMambaLayer", SSD),
    "granitemoehybrid-limit": ({**GRANITE, "time_step_limit": (0.3, 0.9)},
                               "GraniteMoeHybridMambaLayer", SSD),
    "nemotron_h": (NEMOTRON, "NemotronHMamba2Mixer", SSD),
    "bamba": ({**MAMBA2, "num_hidden_layers": 4, "attn_layer_indices": [1]}, "BambaMixer",
              SSD),
    "zamba2": (ZAMBA2, "Zamba2MambaMixer", SSD),
    "zamba2-floor": ({**ZAMBA2, "time_step_min": 0.5, "time_step_max": 1.0},
                     "Zamba2MambaMixer", SSD),
    "falcon_h1": (FALCON, "FalconH1Mixer", SSD),
    "falcon_h1-norm": ({**FALCON, "mamba_rms_norm": True}, "FalconH1Mixer", SSD),
    "falcon_h1-gatenorm": ({**FALCON, "mamba_rms_norm": True,
                            "mamba_norm_before_gate": False}, "FalconH1Mixer", SSD),
    "mamba2": (PURE_MAMBA2, "Mamba2Mixer", SSD),
    "jamba": (JAMBA, "JambaMambaMixer", ((64, 4), (64, 8, 1))),
    "mamba": (MAMBA1, "MambaMixer", ((64, 4), (64, 8, 1))),
    "falcon_mamba": (MAMBA1, "FalconMambaMixer", ((64, 4), (64, 8, 1))),
}
#: the layer types whose layers keep a state (Zamba2's and Falcon-H1's "hybrid" layers
#: have attention too; Nemotron-H's "mlp" and "moe" layers keep nothing)
STATEFUL = {"linear_attention", "conv", "hybrid"}
TOL = 2e-5


def built(family, seed=0):
    """The tiny float32 model of `family` (eval), its mixer modules' weights redrawn so
    that every part of them moves the output by O(1)."""
    fields, _, _ = FAMILIES[family]
    model_type = family.split("-")[0]
    config = transformers.AutoConfig.for_model(
        model_type, **{**COMMON, **{k: v for k, v in fields.items() if v is not None}})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    for module in mixer_modules(model):
        redraw(module)
    return model


def mixer_modules(model):
    return [m for m in model.modules() if type(m).__name__ in mixers.MIXERS]


@torch.no_grad()
def redraw(module):
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.empty_like(p).uniform_(1, 8).log())
        elif leaf == "dt_bias":
            p.copy_(torch.randn_like(p) * 0.5)
        elif "norm" in name:
            p.copy_(1 + 0.3 * torch.randn_like(p))
        elif p.dim() == 1:          # biases
            p.copy_(0.3 * torch.randn_like(p))
        elif p.dim() == 3:          # depthwise conv weights [C, 1, K]
            p.copy_(torch.randn_like(p) * 0.6)
        else:                       # projections [out, in]
            p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)


def hf_out(module, hidden):
    """The module's own output for one sequence (batch 1, no cache)."""
    with torch.no_grad():
        return module(hidden[None])[0]


def ours(module, hidden, ops):
    with torch.no_grad():
        return mixers.forward(module, hidden, ops)


def assert_close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= TOL * max(1.0, want.abs().max().item()), err


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, built(request.param)


def test_each_family_is_built_with_its_mixers_and_their_state_shapes(family):
    name, model = family
    _, cls, state = FAMILIES[name]
    modules = mixer_modules(model)
    assert len(modules) == 2 if name.startswith("lfm") else len(modules) == 3
    for module in modules:
        assert type(module).__name__ == cls
        assert mixers.state_shape(module) == state


def test_the_mixer_layers_are_the_layers_whose_type_keeps_a_state(family):
    _, model = family
    kinds = model.config.layer_types
    layers = mixers.mixer_layers(model)
    assert sorted(layers) == [i for i, kind in enumerate(kinds) if kind in STATEFUL]
    assert list(layers.values()) == mixer_modules(model)


def test_a_packed_row_of_the_decoder_layers_shape_is_taken(family):
    _, model = family
    module = mixer_modules(model)[0]
    hidden = torch.randn(1, 5, model.config.hidden_size)
    assert_close(ours(module, hidden, RefOps()), hf_out(module, hidden[0])[None])
    with pytest.raises(kv.ConfigError, match=r"hidden states of 2 rows; a packed step is "
                                             r"one row \[1, T, hidden\]"):
        ours(module, hidden.expand(2, 5, -1), RefOps())


def test_one_sequence_in_one_shot_equals_the_module(family):
    name, model = family
    torch.manual_seed(1)
    for module in mixer_modules(model):
        hidden = torch.randn(70, model.config.hidden_size)   # past HF's 64-token chunk
        ops = RefOps()
        assert_close(ours(module, hidden, ops), hf_out(module, hidden))
        op = None if name.startswith("lfm") else "ssd" if FAMILIES[name][2] == SSD \
            else "delta_rule"
        assert ops.calls == {"conv": 1, "delta_rule": op == "delta_rule", "ssd": op == "ssd"}


#: where a sequence is cut into chunks: each family takes one, in turn (single tokens, a
#: long prefix, a step of one token between two)
CUTS = [(5,), (1, 2, 3, 11), (9, 10)]


def test_one_sequence_in_chunks_continues_from_the_ops_state(family):
    name, model = family
    cuts = CUTS[sorted(FAMILIES).index(name) % len(CUTS)]
    torch.manual_seed(2)
    hidden = torch.randn(13, model.config.hidden_size)
    for module in mixer_modules(model):
        ops = RefOps()
        bounds = [0, *cuts, len(hidden)]
        got = torch.cat([ours(module, hidden[a:b], ops) for a, b in zip(bounds, bounds[1:])])
        assert_close(got, hf_out(module, hidden))


def test_packed_sequences_each_equal_the_sequence_alone(family):
    """Three steps of two sequences packed on one token axis, in the orders a step puts
    them (A then B, B then A, then one token each as in decode): each sequence's outputs
    equal its own one-shot output."""
    _, model = family
    torch.manual_seed(3)
    a = torch.randn(12, model.config.hidden_size)
    b = torch.randn(8, model.config.hidden_size)
    steps = [[(0, a, 0, 6), (1, b, 0, 2)], [(1, b, 2, 7), (0, a, 6, 11)],
             [(0, a, 11, 12), (1, b, 7, 8)]]
    for module in mixer_modules(model):
        ops = RefOps()
        outs = {0: [], 1: []}
        for step in steps:
            hidden = torch.cat([x[lo:hi] for _, x, lo, hi in step])
            ops.seqs([seq for seq, _, lo, hi in step for _ in range(lo, hi)])
            out = ours(module, hidden, ops).split([hi - lo for _, _, lo, hi in step])
            for (seq, *_), part in zip(step, out):
                outs[seq].append(part)
        assert_close(torch.cat(outs[0]), hf_out(module, a))
        assert_close(torch.cat(outs[1]), hf_out(module, b))


#: parameters `transformers` keeps in float32 in a bfloat16 model (as it loads them)
FLOAT32_KEPT = {"bailing": ("conv1d.weight", "forget_gate.A_log", "forget_gate.dt_bias"),
                "kimi": ("forget_gate.dt_bias",)}


def test_a_bfloat16_mixer_returns_bfloat16_as_close_to_the_module_as_bfloat16_allows(family):
    """Bailing keeps its conv weight and decay parameters in float32 in a bfloat16 model,
    Kimi its decay bias: the conv runs on a bfloat16 input with a float32 weight, and the
    output is bfloat16, within bfloat16 rounding of the module's own."""
    name, model = family
    module = mixer_modules(built(name))[0].to(torch.bfloat16)
    kept = FLOAT32_KEPT.get(name.split("_")[0], ())
    for key, p in module.named_parameters():
        if key in kept:
            p.data = p.data.float()
    assert sum(p.dtype == torch.float32 for p in module.parameters()) == len(kept)
    torch.manual_seed(4)
    hidden = torch.randn(10, model.config.hidden_size).bfloat16()
    got, want = ours(module, hidden, RefOps()), hf_out(module, hidden)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max()


@pytest.mark.parametrize("name", ["granitemoehybrid", "falcon_h1-norm"])
def test_a_mamba2_mixer_through_the_caches_own_state_layer_equals_the_module(name):
    """The Mamba2 scan through a `BatchedSequenceCache` state layer (`mixing.LayerOps`:
    its `ssd`): two sequences packed
    over three steps, each equal to the module's own output alone."""
    import numpy as np

    from kvnumba.hf import mixing
    module = mixer_modules(built(name))[0]
    conv, recurrent = mixers.state_shape(module)
    cache = kv.BatchedSequenceCache(kv.CacheConfig(
        layers=[kv.state(conv=conv, recurrent=recurrent), kv.flat()], n_kv_heads=1,
        head_dim=8, capacity=40, max_seqs=2, max_write=8, max_step=16, page_size=8,
        dtype="float32"))
    ops = mixing.LayerOps(cache, 0)
    torch.manual_seed(3)
    a, b = torch.randn(9, 32), torch.randn(6, 32)
    sa, sb = cache.seq_new(), cache.seq_new()
    steps = [[(sa, a, 0, 5), (sb, b, 0, 2)], [(sb, b, 2, 5), (sa, a, 5, 8)],
             [(sa, a, 8, 9), (sb, b, 5, 6)]]
    outs = {sa: [], sb: []}
    for step in steps:
        ids = np.asarray([seq for seq, _, lo, hi in step for _ in range(lo, hi)])
        cache.declare_step(ids)
        cache.prepare_step()
        out = ours(module, torch.cat([x[lo:hi] for _, x, lo, hi in step]), ops)
        zeros = np.zeros((len(ids), 1, 8), np.float32)
        cache.write(1, zeros, zeros)
        cache.commit_step()
        for (seq, *_), part in zip(step, out.split([hi - lo for _, _, lo, hi in step])):
            outs[seq].append(part)
    assert_close(torch.cat(outs[sa]), hf_out(module, a))
    assert_close(torch.cat(outs[sb]), hf_out(module, b))


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7, 8, 9, 3, 4, 5, 6]]


@pytest.mark.parametrize("name", ["granitemoehybrid"] + (["bamba"] if THOROUGH else []))
def test_granite_and_bamba_are_served_as_they_generate(name):
    """Mamba2 layers beside attention layers, one decoder layer each: an engine (probe
    on) serving two prompts packed gives each prompt's own greedy `generate()` tokens
    (Bamba, of the same layout, under the thorough profile)."""
    import kvnumba.hf as kvhf
    model = built(name)
    want = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    engine = kvhf.Engine(model, max_seqs=2, capacity=24, dtype="float32")
    assert engine.generate(PROMPTS, max_new_tokens=3) == want


#: model -> (its cache layers' kinds, decoder layer -> cache layer of its attention, of
#: its mixer)
LAID_OUT = {
    # mamba, mlp, mamba, attention, moe, mamba: the mlp and moe layers store nothing
    "nemotron_h": (["state", "state", "flat", "state"], {3: 2}, {0: 0, 2: 1, 5: 3}),
    # mamba, hybrid (the shared attention block, then its mamba mixer), mamba
    "zamba2": (["state", "flat", "state", "state"], {1: 1}, {0: 0, 1: 2, 2: 3}),
    # attention and mamba side by side in every layer
    "falcon_h1": (["flat", "state"] * 3, {0: 0, 1: 2, 2: 4}, {0: 1, 1: 3, 2: 5}),
    "mamba2": (["state"] * 3, {}, {0: 0, 1: 1, 2: 2}),
}


@pytest.mark.parametrize("name", sorted(LAID_OUT))
def test_each_decoder_layers_parts_map_to_their_cache_layers(name):
    """A decoder layer of attention and a mixer takes two cache layers (its attention's
    first), one of neither takes none, a model of mixers alone has no attention layer
    (no pages, no bytes per token, no byte budget to share); the served model reads the
    same map and refuses a config laid out otherwise."""
    import kvnumba.hf as kvhf
    from kvnumba.hf import config as hfconfig
    from kvnumba.hf.mixing import state_specs
    model = built(name)
    kinds, attention, mixed = LAID_OUT[name]
    config = kvhf.cache_config(model, max_seqs=1, capacity=24, dtype="float32")
    assert [kind.name for kind in config.kinds] == kinds
    mapped = hfconfig.model_layer_map(model.config, state_specs(model))
    assert (mapped.attention, mapped.mixers, mapped.n_layers) == (attention, mixed,
                                                                   len(kinds))
    assert mapped.identity == (name == "mamba2")
    assert [config.layers[i] for i in mixed.values()] == \
        [kv.state(conv=SSD[0], recurrent=SSD[1])] * len(mixed)
    assert (config.bytes_per_token == 0) == (not attention)
    from kvnumba.hf.served import ServedModel
    with pytest.raises(kv.ConfigError, match=rf"the cache config has 1 layers; the model's "
                                             rf"decoder layers take {len(kinds)}"):
        ServedModel(model, kv.CacheConfig(layers=[kv.flat()], head_dim=8, capacity=24,
                                          max_write=8, max_step=16, dtype="float32"))
    if not attention:                         # no page pool for a byte budget to size
        with pytest.raises(kv.ConfigError, match=r"kv_bytes=1048576: every layer of the "
                                                 r"model is a state layer.*leave kv_bytes"):
            hfconfig.budgeted([config], 1 << 20)


def test_the_layer_map_of_each_layer_type():
    """`layermap.layer_map` from layer types alone: an attention type one cache layer,
    a mixer's one, `hybrid` / `hybrid_sliding` two (attention first), `mlp` / `moe`
    none; a model of one part a layer maps each layer to itself."""
    from kvnumba.hf.layermap import layer_map
    mapped = layer_map(["hybrid_sliding", "mlp", "full_attention", "linear_attention",
                        "moe", "hybrid"], {0, 3, 5})
    assert mapped.attention == {0: 0, 2: 2, 5: 4} and mapped.mixers == {0: 1, 3: 3, 5: 5}
    assert mapped.parts() == [(0, "attention"), (0, "mixer"), (2, "attention"),
                              (3, "mixer"), (5, "attention"), (5, "mixer")]
    plain = layer_map(["conv", "full_attention", "sliding_attention"], {0})
    assert plain.identity and plain.n_layers == 3


def test_a_sliding_hybrid_layer_gets_a_ring_for_its_attention():
    """`hybrid_sliding` (attention within a window beside a mixer) lays out a ring layer,
    then the state layer; without a `sliding_window`, or without a mixer kvnumba
    computes (Zaya's hybrid layers), it is refused naming the type."""
    from types import SimpleNamespace

    from kvnumba.hf import config as hfconfig
    state = kv.state(conv=(8, 4))
    fields = dict(model_type="tiny", num_hidden_layers=2,
                  layer_types=["hybrid_sliding", "full_attention"])
    specs = hfconfig.layer_specs(SimpleNamespace(**fields, sliding_window=4), states={0: state})
    assert specs == [kv.ring(4), state, kv.flat()]
    with pytest.raises(kv.ConfigError, match="hybrid_sliding layers without a sliding_window"):
        hfconfig.layer_specs(SimpleNamespace(**fields), states={0: state})
    with pytest.raises(kv.ConfigError, match=r"tiny: layer 0 is a 'hybrid_sliding' layer, "
                                             r"attention beside a mixer, and holds no mixer "
                                             r"kvnumba computes"):
        hfconfig.layer_specs(SimpleNamespace(**fields, sliding_window=4))


def test_a_module_kvnumba_does_not_compute_is_refused_naming_it():
    with pytest.raises(kv.ConfigError, match=r"Linear: a mixer kvnumba does not compute"):
        mixers.forward(torch.nn.Linear(2, 2), torch.zeros(1, 2), RefOps())
    with pytest.raises(kv.ConfigError, match=r"Linear: a mixer kvnumba does not compute"):
        mixers.state_shape(torch.nn.Linear(2, 2))


def test_a_conv_activation_the_op_does_not_compute_is_refused():
    model = built("qwen3_5_text")
    module = mixer_modules(model)[0]
    module.activation = "gelu"
    with pytest.raises(kv.ConfigError, match=r"Qwen3_5GatedDeltaNet: its convolution's "
                                             r"activation 'gelu' is not computed"):
        ours(module, torch.zeros(3, 32), RefOps())


def test_every_mixer_class_is_one_the_installed_transformers_defines():
    """`MIXERS` names real classes (a renamed class would never be matched)."""
    import importlib
    homes = {"Qwen3Next": "qwen3_next", "Qwen3_5Moe": "qwen3_5_moe", "Qwen3_5": "qwen3_5",
             "OlmoHybrid": "olmo_hybrid", "KimiLinear": "kimi_linear",
             "BailingHybrid": "bailing_hybrid", "Lfm2Moe": "lfm2_moe", "Lfm2": "lfm2",
             "Lfm3": "lfm3", "GraniteMoeHybrid": "granitemoehybrid",
             "NemotronH": "nemotron_h", "Bamba": "bamba", "Zamba2": "zamba2",
             "FalconH1": "falcon_h1", "Mamba2": "mamba2", "Jamba": "jamba",
             "FalconMamba": "falcon_mamba", "Mamba": "mamba"}
    for name in mixers.MIXERS:
        prefix = next(p for p in homes if name.startswith(p))
        module = importlib.import_module(f"transformers.models.{homes[prefix]}."
                                         f"modeling_{homes[prefix]}")
        assert isinstance(getattr(module, name), type), name


@pytest.mark.parametrize("name", ["granitemoehybrid-limit", "zamba2-floor"])
def test_the_time_step_limits_of_the_limit_variants_bind(name):
    """Their `time_step_limit` moves the modules' own outputs, so the tests above check
    that kvnumba clamps the time step as `transformers`' prefill does."""
    module = mixer_modules(built(name))[0]
    torch.manual_seed(5)
    hidden = torch.randn(20, 32)
    want = hf_out(module, hidden)
    module.time_step_limit = (0.0, float("inf"))
    assert (hf_out(module, hidden) - want).abs().max() > 1e-2


@pytest.mark.parametrize("name,binds", [("granitemoehybrid", False),
                                        ("granitemoehybrid-limit", True),
                                        ("zamba2-floor", True)])
def test_transformers_decode_step_does_not_clamp_the_time_step(name, binds):
    """`transformers`' decode step (one token on a cached state) skips the
    `time_step_limit` its prefill applies: where the limit binds, its decode output
    differs from its one-shot prefill's, which kvnumba computes for every token whatever
    the cut (the chunked tests above); at the default `(0, inf)` the two agree."""
    model = built(name)
    module = mixer_modules(model)[0]
    torch.manual_seed(5)
    hidden = torch.randn(6, 32)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        module(hidden[None, :5], cache=cache)
        decoded = module(hidden[None, 5:], cache=cache)[0]
    want = hf_out(module, hidden)[5:]
    assert ((decoded - want).abs().max() > 1e-2) == binds
    ops = RefOps()
    assert_close(torch.cat([ours(module, hidden[:5], ops), ours(module, hidden[5:], ops)]),
                 hf_out(module, hidden))


def test_falcon_h1s_multipliers_reach_its_mixer():
    """The tiny Falcon-H1's muP multipliers are not all 1 (its mixer's `mup_vector` and
    `ssm_in_multiplier`, which kvnumba applies as the module does)."""
    module = mixer_modules(built("falcon_h1"))[0]
    assert module.ssm_in_multiplier == 0.6
    assert sorted(set(module.mup_vector.flatten().tolist())) == pytest.approx(
        [0.5, 0.7, 0.8, 1.3, 1.5])


@pytest.mark.parametrize("model_type,fields,cls", [
    ("qwen3_5", GDN, "Qwen3_5GatedDeltaNet"),
    ("qwen3_5_moe", {**GDN, **MOE}, "Qwen3_5MoeGatedDeltaNet"),
])
def test_the_multimodal_qwen3_5_configs_build_the_text_mixers(model_type, fields, cls):
    """`qwen3_5` / `qwen3_5_moe` (a text and a vision config) build their text model's
    mixers, computed as the text variants'."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                  out_hidden_size=32, patch_size=4, temporal_patch_size=1,
                  num_position_embeddings=16)
    config = transformers.AutoConfig.for_model(
        model_type, text_config={**COMMON, **fields}, vision_config=vision,
        image_token_id=90, video_token_id=91, vision_start_token_id=92,
        vision_end_token_id=93)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    modules = mixer_modules(model)
    assert [type(m).__name__ for m in modules] == [cls] * 3
    redraw(modules[0])
    hidden = torch.randn(9, 32)
    assert_close(ours(modules[0], hidden, RefOps()), hf_out(modules[0], hidden))
