"""What `kvnumba.hf.Engine` promises a user (contract §13): a call checked whole before
anything is queued, drawn or seeded; torch's global generators left alone; bfloat16
checkpoints served without ml_dtypes; a model in training mode with attention dropout
refused up front; a KV byte budget. Every refusal is typed, queues nothing, leaves the
caches as they were and the engine serving the next call right."""
import subprocess
import sys

import numpy as np
import pytest

import kvnumba as kv
from snapshot import snapshot

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvhf = pytest.importorskip("kvnumba.hf")

from hfmodels import PROMPTS, generated, tiny  # noqa: E402


@pytest.fixture(scope="module")
def served():
    """An engine over a tiny Llama with one request served, and that request's output."""
    model = tiny("llama")
    engine = kvhf.Engine(model, verify=False, max_seqs=2, capacity=12, max_write=4, dtype="float32")
    want = generated(model, PROMPTS[0], 2)
    assert engine.generate([PROMPTS[0]], max_new_tokens=2) == [want]
    return engine, want


BAD_CALLS = [
    # (what, call, error, message)
    ("a later prompt past the vocabulary", dict(prompts=[PROMPTS[0], [1, 64]]), kv.ConfigError,
     r"outside the vocabulary"),
    ("a later prompt nested", dict(prompts=[PROMPTS[0], [[1, 2]]]), kv.ConfigError,
     r"1-D sequence of int token ids"),
    ("a later prompt too long", dict(prompts=[PROMPTS[0], [1] * 12]), kv.CapacityError,
     r"capacity is 12"),
    ("no prompts", dict(prompts=None), kv.ConfigError, r"a list of prompts"),
    ("a flat list", dict(prompts=[1, 5, 9]), kv.ConfigError, r"\[ids\] for one prompt"),
    ("a tokenizer's encoding", dict(prompts={"input_ids": [[1, 2]], "attention_mask": [[1, 1]]}),
     kv.ConfigError, r"encoding\['input_ids'\]"),
    ("a string seed", dict(seed="7"), kv.ConfigError, r"seed='7'"),
    ("a bool seed", dict(seed=True), kv.ConfigError, r"seed=True"),
    ("a seed past 2**64", dict(seed=2**64), kv.ConfigError, r"\[0, 2\*\*64\)"),
    ("seeds of two prompts past 2**64", dict(prompts=[[1], [2]], seed=2**64 - 1),
     kv.ConfigError, r"seed \.\. seed \+ 1"),
    ("a float eos", dict(eos_token_id=2.0), kv.ConfigError, r"eos_token_id=2.0"),
    ("a bool eos", dict(eos_token_id=True), kv.ConfigError, r"eos_token_id=True"),
    ("a 0-d array eos", dict(eos_token_id=np.array(3)), kv.ConfigError, r"eos_token_id="),
    ("an eos past the vocabulary", dict(eos_token_id=[3, 64]), kv.ConfigError,
     r"\[64\] outside the vocabulary"),
]


def test_a_refused_generate_queues_nothing(served):
    """Each bad call is refused with its typed error, before anything is queued (a later
    prompt's fault included): the engine stays idle, the cache as it was, no request id
    is drawn, and the next call is served right."""
    engine, want = served
    last = drained(engine, engine.submit([1], max_new_tokens=1))
    before = snapshot(engine.target.table)
    for what, call, error, message in BAD_CALLS:
        kw = {"prompts": [PROMPTS[0]], "max_new_tokens": 2, **call}
        with pytest.raises(error, match=message):
            engine.generate(kw.pop("prompts"), **kw)
        assert not engine.busy, what
        assert snapshot(engine.target.table) == before, what
    assert drained(engine, engine.submit([1], max_new_tokens=1)) == last + 1   # no id drawn
    assert engine.generate([PROMPTS[0]], max_new_tokens=2) == [want]


def drained(engine, rid: int) -> int:
    """`rid`, once the engine has served everything queued."""
    while engine.busy:
        engine.step()
    return rid


def test_a_refused_submit_draws_no_id_and_seeds_nothing(served):
    engine, _ = served
    rid = drained(engine, engine.submit([1, 2], max_new_tokens=1))
    torch.manual_seed(5)
    want = torch.rand(2)
    torch.manual_seed(5)
    for eos in (2.0, True, np.array(3), "2"):
        with pytest.raises(kv.ConfigError, match="eos_token_id"):
            engine.submit([1, 2], max_new_tokens=1, eos_token_id=eos, seed=3)
    assert torch.equal(torch.rand(2), want)
    assert drained(engine, engine.submit([1, 2], max_new_tokens=1)) == rid + 1


def test_the_global_generator_is_left_alone(served):
    """After `torch.manual_seed(123)`, submits (greedy, and sampled without a seed) and
    their steps, `torch.rand` draws what a fresh manual_seed(123) draws."""
    engine, _ = served
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    engine.submit([1, 2], max_new_tokens=1)
    engine.submit([5], max_new_tokens=2, temperature=0.7, n=1)
    while engine.busy:
        engine.step()
    assert torch.equal(torch.rand(3), want)


def test_seeded_sampled_requests_repeat_and_unseeded_ones_differ():
    """Two requests with one seed sample the same tokens; three without a seed draw
    fresh entropy each (served together, in one engine run; at temperature 2 three
    unseeded pairs of tokens all alike would be a one-in-millions chance)."""
    engine = kvhf.Engine(tiny("llama"), verify=False, max_seqs=5, capacity=8, dtype="float32")
    rids = [engine.submit([1, 2], max_new_tokens=2, temperature=2.0, seed=seed)
            for seed in (4, 4, None, None, None)]
    done = {}
    while engine.busy:
        done.update(engine.step())
    outputs = [tuple(done[rid]) for rid in rids]
    assert outputs[0] == outputs[1]
    assert len(set(outputs[2:])) > 1


def test_a_model_in_training_mode_with_attention_dropout_is_refused_up_front():
    model = tiny("llama", attention_dropout=0.1)
    model.train()
    with pytest.raises(kv.ConfigError, match=r"training mode with attention dropout 0.1.*"
                                             r"model.eval\(\)"):
        kvhf.Engine(model, verify=False, max_seqs=1, capacity=8, dtype="float32")
    model.eval()
    engine = kvhf.Engine(model, verify=False, max_seqs=1, capacity=8, dtype="float32")
    model.train()                                   # switched after construction
    with pytest.raises(kv.ConfigError, match="training mode"):
        engine.submit([1, 2], max_new_tokens=1)
    assert not engine.busy
    model.eval()
    assert engine.generate([[1, 2]], max_new_tokens=2) == [generated(model, [1, 2], 2)]


def test_a_kv_byte_budget_makes_fixed_pools_that_still_serve_every_request():
    model = tiny("mistral")
    config = kvhf.cache_config(model, max_seqs=2, capacity=16, dtype="float32")
    budget = 24 * config.page_size * config.bytes_per_token
    engine = kvhf.Engine(model, verify=False, max_seqs=2, capacity=16, dtype="float32", kv_bytes=budget)
    pools = engine.target.cache.pool_pages()
    assert all(p.allocated == p.max_pages == 24 for p in pools)
    assert engine.target.cache.nbytes == budget
    want = [generated(model, p, 3) for p in PROMPTS]
    assert engine.generate(PROMPTS, max_new_tokens=3) == want
    assert [p.allocated for p in engine.target.cache.pool_pages()] == [24] * len(pools)
    with pytest.raises(kv.ConfigError, match="kv_bytes"):
        kvhf.Engine(model, verify=False, max_seqs=2, capacity=16, dtype="float32", kv_bytes=0)


def test_a_bfloat16_checkpoint_is_served_without_ml_dtypes():
    """With `ml_dtypes` unimportable, an engine over a model in bfloat16 (storage bfloat16)
    serves it, its greedy tokens those of `model.generate()` (a subprocess: the import
    is blocked before kvnumba is imported)."""
    script = """
import sys
sys.modules["ml_dtypes"] = None            # `import ml_dtypes` raises ImportError
import torch
sys.path.insert(0, "tests")
from hfmodels import generated, tiny
import kvnumba.hf as kvhf
model = tiny("llama").to(torch.bfloat16)
engine = kvhf.Engine(model, verify=False, max_seqs=1, capacity=12)
assert engine.target.cache.config.dtype == "bfloat16"
got = engine.generate([[1, 5, 9]], max_new_tokens=2)
assert got == [generated(model, [1, 5, 9], 2)], got
print("served", got)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "served" in done.stdout
