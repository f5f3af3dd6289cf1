"""Hybrid models served through the cache's state layers (contract §17): tiny random
models built from `transformers`' own configs with every layer type their real configs
have (the mixers' weights redrawn so every part of them matters), served token for
token against their own `generate()` (float32 storage, greedy, the probe on): prompts of
several lengths packed in one step, `n > 1` forks, and a draft model whose proposals are
mostly rejected (every rejection rewinds the mixers' states), which `generate()` refuses
for these models. One family per kind of mixer: the gated delta rule (Qwen3-Next), its
per-channel gate beside latent attention (Kimi-Linear), short convolutions (LFM2); and
one per way decoder layers map to cache layers: layers storing nothing beside Mamba-2
mixers (Nemotron-H), attention and a mixer in one layer (Falcon-H1), mixers alone (Mamba-2,
served with prefix hits; packed, forked and drafted under the thorough profile beside
Zamba2's shared attention, Falcon-H1's other norm and Jamba's Mamba1 mixers); the
registry serves the rest."""
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvnumba as kv  # noqa: E402
from hfmodels import generated, kvhf  # noqa: E402
from test_hf_mixers import COMMON, built  # noqa: E402

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7, 2, 8], [1, 2, 3, 4, 5, 6]]
NEW = 3
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
#: the families served below: each kind of mixer, each way of laying decoder layers out
FAMILIES = ["qwen3_next", "kimi_linear", "lfm2", "nemotron_h", "falcon_h1-norm"] + \
    (["mamba2", "zamba2", "falcon_h1-gatenorm", "jamba"] if THOROUGH else [])


def draft_model():
    """A tiny llama of the hybrids' vocabulary: its proposals mostly miss."""
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1, "head_dim": 8})
    torch.manual_seed(7)
    return transformers.LlamaForCausalLM(config).eval()


#: the cache layers each decoder layer type takes: attention (False) and state (True)
PARTS = {"full_attention": [False], "sliding_attention": [False], "linear_attention": [True],
         "conv": [True], "hybrid": [False, True], "mlp": [], "moe": []}


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_served_packed_forked_and_drafted_as_generated(family):
    model = built(family)
    want = [generated(model, prompt, NEW) for prompt in PROMPTS]
    engine = kvhf.Engine(model, max_seqs=3, capacity=32, dtype="float32",
                         draft_model=draft_model(), draft_len=2)
    config = engine.target.cache.config
    layer_types = model.config.layer_types
    assert [spec.keeps_state for spec in config.layers] == \
        [part for t in layer_types for part in PARTS[t]]
    assert engine.generate(PROMPTS, max_new_tokens=NEW) == want
    assert engine.proposed > engine.accepted                 # rejections rewound the states
    assert engine.generate(PROMPTS[:1], max_new_tokens=2, n=2) == [want[0][:2]] * 2


def test_hybrid_over_bfloat16_storage_stays_near_float32():
    """The conv window in bfloat16, then the recurrent states too (`state_dtype`): logits
    within the 16-bit storage tolerance of the other families."""
    from hfmodels import STORAGE_TOLERANCE, prefill_logits
    model = built("qwen3_next")
    exact = prefill_logits(model, "float32", PROMPTS[0])
    for options in ({}, {"state_dtype": "bfloat16"}):
        near = prefill_logits(model, "bfloat16", PROMPTS[0], **options)
        assert (near - exact).abs().max().item() < STORAGE_TOLERANCE["bfloat16"], options


def test_hybrid_cache_config_counts_the_states_per_sequence():
    model = built("qwen3_next")
    config = kvhf.cache_config(model, max_seqs=2, capacity=32, max_write=8, dtype="float32")
    conv, recurrent = (96, 4), (4, 8, 16)
    assert config.layers == (kv.state(conv=conv, recurrent=recurrent),) * 3 + (
        config.layers[3],)
    per_layer = (4 - 1 + 8) * 96 * 4 + 2 * 4 * 8 * 16 * 4 + 3 * 8 * 4 * (2 * 8 + 16 + 1) * 4
    assert config.bytes_per_sequence == 3 * per_layer


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2", "mamba2"] +
                         (["nemotron_h", "zamba2"] if THOROUGH else []))
def test_hybrid_prefix_hits_restore_the_mixers_states(family):
    """A conversation's next turn starts from the previous turn's last snapshotted page
    (its states and conv windows restored from the index) and generates what
    `generate()` does over the whole conversation."""
    model = built(family)
    engine = kvhf.Engine(model, verify=False, max_seqs=1, capacity=40, max_write=8,
                         dtype="float32", page_size=8)
    first = PROMPTS[0] + PROMPTS[1]                   # 13 tokens
    answer = engine.generate([first], max_new_tokens=4)[0]
    assert answer == generated(model, first, 4)       # 16 committed: 2 whole pages indexed
    second = first + answer + [21, 22]                # 19 tokens: both pages hit
    assert engine.generate([second], max_new_tokens=NEW)[0] == generated(model, second, NEW)
    assert engine.stats.cached_tokens == 16


@pytest.mark.skipif(not THOROUGH, reason="prefills of 40 tokens through the simulator: "
                    "about 3 minutes a family, under HYPOTHESIS_PROFILE=thorough")
@pytest.mark.parametrize("family,fields", [
    ("qwen3_next", {"linear_key_head_dim": 16}),       # heads of 16 x 16
    ("kimi_linear", {"linear_head_dim": 16}),          # 16 x 16, a gate per key channel
    ("mamba2", {"state_size": 16}),                    # heads of 16 x 16, state transposed
])
def test_a_prefill_on_the_chunked_kernel_generates_as_generate_does(family, fields):
    """Mixers whose heads fit the chunked kernel (dims multiples of 16): a prompt of 40
    tokens prefills in one step, a chunk of 32 on the tensor cores and 8 more, beside a
    prompt of 7 a token at a time; both continue as `generate()` does."""
    import numpy as np

    import test_hf_mixers
    base, mixer, _ = test_hf_mixers.FAMILIES[family]
    name = f"{family}-chunked"
    test_hf_mixers.FAMILIES[name] = ({**base, **fields}, mixer, None)
    try:
        model = built(name)
    finally:
        del test_hf_mixers.FAMILIES[name]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 96, 40).tolist(), rng.integers(3, 96, 7).tolist()]
    engine = kvhf.Engine(model, max_seqs=2, capacity=64, dtype="float32")
    assert engine.generate(prompts, max_new_tokens=4) == \
        [generated(model, prompt, 4) for prompt in prompts]
