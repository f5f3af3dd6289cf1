"""`kvnumba.hf`: `transformers` models served through the cache, token for token against
`model.generate()` (tiny random models built from their config classes; float32
storage unless said; on the simulator the kernels are the same as on a GPU). The
models have one layer (Gemma-2 two: a sliding and a full one) and the runs a few
tokens: the simulator runs each CUDA thread as a Python thread, and these tests are
about the plumbing between `transformers` and the cache, not about size."""
import os

import numpy as np
import pytest

import kvnumba as kv

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hfmodels import ARCHITECTURES, PROMPTS, generated, kvhf, tiny  # noqa: E402

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES) if THOROUGH else
                         sorted(set(ARCHITECTURES) - {"qwen2"}))
def test_continuous_batching_matches_generate(arch):
    """Two requests submitted at different steps, the longer prompt prefilled in chunks
    of max_write tokens beside the other's decode steps (Qwen2, whose attention is
    Llama's with biased projections, under the thorough profile)."""
    model = tiny(arch)
    want = [generated(model, p, 4) for p in PROMPTS]
    engine = kvhf.Engine(model, verify=False, max_seqs=2, capacity=24, max_write=4, dtype="float32")
    first = engine.submit(PROMPTS[0], max_new_tokens=4)
    done = dict(engine.step())
    second = engine.submit(PROMPTS[1], max_new_tokens=4)
    while engine.busy:
        done.update(engine.step())
    assert [done[first], done[second]] == want


def test_forks_share_one_prefill_and_wait_for_free_sequences():
    """n = 2: each prompt prefilled once and forked; with 3 sequences the second
    request's two wait until the first's finish. Greedy: every fork is the model's
    greedy output."""
    model = tiny("llama")
    want = [generated(model, p, 4) for p in PROMPTS]
    engine = kvhf.Engine(model, verify=False, max_seqs=3, capacity=24, max_write=8, dtype="float32")
    first = engine.submit(PROMPTS[0], max_new_tokens=4, n=2)
    second = engine.submit(PROMPTS[1], max_new_tokens=4, n=2)
    engine.step()
    assert len(engine.target.table) == 2       # forked; the second request waits
    done = {}
    while engine.busy:
        done.update(engine.step())
    assert done == {first: [want[0]] * 2, second: [want[1]] * 2}


def test_the_attention_function_refuses_what_it_cannot_serve_before_writing():
    """A layer call whose sliding window is not its cache layer's, attention dropout,
    learned sinks of another head count, a position bias, a non-causal call, attention weights asked for, an
    argument the function does not know, and a call outside a kvnumba step: each a
    ConfigError naming the layer and the piece, with nothing written into the prepared
    step."""
    from types import SimpleNamespace

    from kvnumba.hf.attention import attend
    cache = kv.BatchedSequenceCache(kv.CacheConfig(
        layers=[kv.flat(), kv.ring(window=4)], n_kv_heads=1, head_dim=8, capacity=8,
        max_seqs=1, max_write=2, max_step=2, dtype="float32"))
    cache.declare_step([cache.seq_new()] * 2)
    cache.prepare_step()
    q, k = torch.zeros(1, 2, 2, 8), torch.zeros(1, 1, 2, 8)
    refusals = [
        (dict(module=SimpleNamespace(layer_idx=0), sliding_window=4, kvnumba_cache=cache),
         r"layer 0: the model attends with sliding_window=4, the cache's layer has window "
         r"None"),
        (dict(module=SimpleNamespace(layer_idx=1), sliding_window=None, kvnumba_cache=cache),
         r"layer 1: .*sliding_window=None, the cache's layer has window 4"),
        (dict(module=SimpleNamespace(layer_idx=1), sliding_window=4, dropout=0.1,
              kvnumba_cache=cache), r"attention dropout 0.1 \(put the model in eval mode\)"),
        (dict(module=SimpleNamespace(layer_idx=0)), r"runs inside a kvnumba step"),
        (dict(module=SimpleNamespace(layer_idx=0), kvnumba_cache=cache, s_aux=torch.zeros(3)),
         r"layer 0: the model's sinks hold 3 heads, its queries 2"),
        (dict(module=SimpleNamespace(layer_idx=1), sliding_window=4, kvnumba_cache=cache,
              position_bias=torch.zeros(1)), r"layer 1: .*position_bias= \(a position bias"),
        (dict(module=SimpleNamespace(layer_idx=0), kvnumba_cache=cache, is_causal=False),
         r"layer 0: .*is_causal=False \(bidirectional attention\)"),
        (dict(module=SimpleNamespace(layer_idx=0), kvnumba_cache=cache, output_attentions=True),
         r"layer 0: the model asks for its attention weights"),
        (dict(module=SimpleNamespace(layer_idx=0), kvnumba_cache=cache, a_new_argument=1.5),
         r"layer 0: .*a_new_argument= \(an argument kvnumba's attention does not know\)"),
    ]
    for kw, match in refusals:
        module = kw.pop("module")
        with pytest.raises(kv.ConfigError, match=match):
            attend(module, q, k, k, **kw)
    assert not cache._steps.step.written.any() and cache.step_state == kv.StepState.PREPARED


def test_the_attention_function_ignores_what_changes_nothing_it_computes():
    """Positions, the model's own cache options and arguments passed as None change
    nothing: the output equals the float64 reference of the same call."""
    from types import SimpleNamespace

    from kvnumba.hf.attention import IGNORED, attend
    from kvnumba.reference import attention
    cache = kv.BatchedSequenceCache(kv.CacheConfig(
        layers=[kv.flat()], n_kv_heads=1, head_dim=8, capacity=8, max_seqs=1, max_write=3,
        max_step=3, dtype="float32"))
    cache.declare_step([cache.seq_new()] * 3)
    cache.prepare_step()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 3, 8, generator=g) for h in (2, 1, 1))
    extra = {name: torch.zeros(1) for name in IGNORED}
    out, weights = attend(SimpleNamespace(layer_idx=0), q, k, v, kvnumba_cache=cache,
                          is_causal=True, s_aux=None, a_new_argument=None, **extra)
    want = attention(*(x[0].transpose(0, 1).double().numpy() for x in (q, k, v)))
    assert weights is None
    np.testing.assert_allclose(out[0].double().numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_bounded_page_pool_admits_requests_as_their_pages_fit():
    """Pages of 8, a pool of 4 (3 besides the scratch page): the first request (5 + 4
    positions: 2 pages) runs, the second (9 + 4: 2 pages) waits with sequences free until
    the first's pages come back; one that could never fit is refused at submit."""
    model = tiny("llama")
    want = [generated(model, p, 4) for p in PROMPTS]
    engine = kvhf.Engine(model, verify=False, max_seqs=3, capacity=24, max_write=8, dtype="float32",
                         page_size=8, max_pages=4)
    from snapshot import snapshot
    before = snapshot(engine.target.table)
    with pytest.raises(kv.CapacityError, match=r"may hold 4 pages of 8 positions on the "
                                               r"flat layers, more than their pool's 3"):
        engine.submit(PROMPTS[1], max_new_tokens=4, n=2)
    assert not engine.busy and snapshot(engine.target.table) == before
    first = engine.submit(PROMPTS[0], max_new_tokens=4)
    second = engine.submit(PROMPTS[1], max_new_tokens=4)
    engine.step()
    assert len(engine.target.table) == 1        # three sequences free, but not the pages
    done = {}
    while engine.busy:
        done.update(engine.step())
    assert done == {first: want[0], second: want[1]}


@pytest.mark.parametrize("own_draft", [False, True], ids=["random-draft", "own-draft"])
def test_speculative_decoding_keeps_the_greedy_output(own_draft):
    """A random draft model (most drafts rejected, each rewound) and the model as its
    own draft (every draft accepted): the output is the model's greedy output."""
    model = tiny("llama")
    want = [generated(model, p, 5) for p in PROMPTS]
    draft = model if own_draft else tiny("llama", seed=1)
    engine = kvhf.Engine(model, verify=False, max_seqs=2, capacity=24, max_write=8, dtype="float32",
                         draft_model=draft, draft_len=3)
    assert engine.generate(PROMPTS, max_new_tokens=5) == want
    rate = engine.acceptance_rate
    assert rate == 1 if own_draft else rate < 0.5, rate


def test_bfloat16_storage_logits_stay_near_float32():
    """Every logit of a prefill with bfloat16 K/V within 0.05 of the float32 run (the
    logits are O(1); bfloat16 keeps 8 bits)."""
    model = tiny("gemma2")
    logits = {}
    for dtype in ("float32", "bfloat16"):
        engine = kvhf.Engine(model, verify=False, max_seqs=1, capacity=16, max_write=16, dtype=dtype)
        sid = engine.target.table.open()
        prompt = PROMPTS[1]
        logits[dtype] = engine.target.run([(sid, 0, prompt)], list(range(len(prompt))))
    assert logits["float32"].abs().max() > 0.1
    torch.testing.assert_close(logits["bfloat16"], logits["float32"], rtol=0, atol=5e-2)


def test_sampling_is_seeded_and_top_p_near_zero_is_greedy():
    model = tiny("llama")
    engine = kvhf.Engine(model, verify=False, max_seqs=2, capacity=24, max_write=8, dtype="float32")
    runs = [engine.generate([PROMPTS[0]], max_new_tokens=3, temperature=5.0, seed=3)
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert engine.generate(PROMPTS[:1], max_new_tokens=3, temperature=1.0, top_p=1e-6) == \
        [generated(model, PROMPTS[0], 3)]


def test_top_p_keeps_the_smallest_most_likely_set_reaching_p():
    """Probabilities 0.5 / 0.3 / 0.15 / 0.05 at top_p = 0.7: the first two, renormalised
    (hand-computed: 0.625 / 0.375 / 0 / 0)."""
    from kvnumba.hf.sampling import Sampling
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    probs = Sampling(temperature=1.0, top_p=0.7).probabilities(logits)
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.625, 0.0, 0.375]]))


def test_speculative_sampling_keeps_the_target_distribution():
    """The acceptance rule: a draft token drawn from q, kept with min(1, p/q), else a
    token from max(0, p - q): the first token out is distributed as p. 40,000 draws
    against p, each frequency within 0.012 (over 5 standard errors)."""
    from kvnumba.hf.sampling import Sampling
    sampling = Sampling(temperature=1.0)
    target = torch.tensor([[2.0, 0.5, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    p = torch.softmax(target[0], -1)
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])
    generator = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, 40_000, replacement=True, generator=generator).tolist()
    first = [sampling.accept(target, [d], q[None], generator)[0] for d in drafts]
    freq = torch.bincount(torch.tensor(first), minlength=4) / len(first)
    assert (freq - p).abs().max() < 0.012, (freq, p)


def test_refusals_leave_the_engine_usable():
    """Each bad request is refused before it is queued: the engine stays idle, the
    cache's states, positions and bytes stay as the served request left them, and the
    next request is served right."""
    from snapshot import snapshot
    model = tiny("llama")
    engine = kvhf.Engine(model, verify=False, max_seqs=2, capacity=12, max_write=4, dtype="float32")
    want = generated(model, PROMPTS[0], 3)
    assert engine.generate([PROMPTS[0]], max_new_tokens=3) == [want]
    before = snapshot(engine.target.table)
    for prompt, kw, error in (([1] * 12, {}, kv.CapacityError), ([], {}, kv.ConfigError),
                              ([64], {}, kv.ConfigError), ([1], {"temperature": -1},
                                                           kv.ConfigError),
                              ([1], {"top_p": 0}, kv.ConfigError), ([1], {"n": 3},
                                                                    kv.CapacityError),
                              ([1], {"max_new_tokens": 0}, kv.ConfigError)):
        with pytest.raises(error):
            engine.submit(prompt, **{"max_new_tokens": 2, **kw})
    assert not engine.busy
    assert snapshot(engine.target.table) == before
    assert engine.generate([PROMPTS[0]], max_new_tokens=3) == [want]


def test_models_kvnumba_cannot_serve_are_refused_naming_the_piece():
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=64, hidden_size=32, n_layer=1, n_head=4))
    with pytest.raises(kv.ConfigError, match="bloom"):
        kvhf.Engine(bloom, verify=False, max_seqs=1, capacity=8)
    model = tiny("llama")
    model.config.layer_types = ["linear_attention"]
    with pytest.raises(kv.ConfigError, match="llama: layer 0 is a 'linear_attention' layer, "
                                             "which kvnumba does not lay out"):
        kvhf.cache_config(model, max_seqs=1, capacity=8)
