"""`Engine.stream_step`: each step's tokens of every running request, joined equal to
`model.generate()`'s and to `step()`'s results; forks reported per sequence; usage with
the prefix index's cached tokens; a request cancelled mid-stream frees its sequences and
leaves the next requests exact. Tiny model, few tokens (the CUDA simulator)."""
import pytest

from hfmodels import PROMPTS, SYSTEM, generated, kvhf, tiny

NEW = 5


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


def drained(engine) -> dict:
    """rid -> (per sequence, its tokens joined over the updates; the last usage; steps
    in which it gained tokens)."""
    out = {}
    while engine.busy:
        for update in engine.stream_step():
            tokens, _, steps, done = out.setdefault(update.rid, ([], None, 0, False))
            assert not done, "an update after the request finished"
            while len(tokens) < len(update.tokens):
                tokens.append([])
            for mine, gained in zip(tokens, update.tokens):
                mine += gained
            out[update.rid] = (tokens, update.usage, steps + any(update.tokens), update.done)
    assert all(done for *_, done in out.values())
    return {rid: value[:3] for rid, value in out.items()}


def test_streamed_tokens_join_to_generates_and_arrive_step_by_step(model):
    engine = kvhf.Engine(model, max_seqs=4, capacity=32, verify=False)
    rids = [engine.submit(p, max_new_tokens=NEW) for p in PROMPTS]
    out = drained(engine)
    for rid, prompt in zip(rids, PROMPTS):
        tokens, usage, steps = out[rid]
        assert tokens == [generated(model, prompt, NEW)]
        assert usage == kvhf.Usage(len(prompt), NEW, 0)
        assert steps == NEW            # one token per step, each reported in its step
    assert engine.usage(rids[0]) is None


def test_forks_stream_per_sequence_and_usage_counts_cached_prompt_tokens(model):
    engine = kvhf.Engine(model, max_seqs=4, capacity=40, verify=False)
    first = engine.submit(SYSTEM + [4], max_new_tokens=2)
    drained(engine)
    rid = engine.submit(SYSTEM + [7, 1], max_new_tokens=3, n=2, temperature=1.0, seed=5)
    out = drained(engine)
    assert first not in out
    tokens, usage, _ = out[rid]
    reference = kvhf.Engine(model, max_seqs=4, capacity=40, verify=False, prefix_cache=False)
    expected = reference.generate([SYSTEM + [7, 1]], max_new_tokens=3, n=2,
                                  temperature=1.0, seed=5)
    assert tokens == expected
    # SYSTEM's two whole pages of 8 came from the index
    assert usage == kvhf.Usage(len(SYSTEM) + 2, 6, 16)


def test_a_request_cancelled_mid_stream_frees_its_sequence_and_the_next_is_exact(model):
    engine = kvhf.Engine(model, max_seqs=2, capacity=32, verify=False)
    cancelled = engine.submit(PROMPTS[1], max_new_tokens=NEW)
    kept = engine.submit(PROMPTS[0], max_new_tokens=NEW)
    gained, early = [], []
    while not gained:
        updates = engine.stream_step()
        gained = [u for u in updates if u.rid == cancelled and u.tokens[0]]
        early += [t for u in updates if u.rid == kept for t in u.tokens[0]]
    indexed = engine.target.cache.prefix_counts.pages
    assert engine.cancel(cancelled)
    assert engine.target.cache.prefix_counts.pages == indexed    # nothing registered
    assert engine.running == 1
    assert engine.usage(cancelled) is None
    out = drained(engine)
    assert cancelled not in out
    assert early + out[kept][0][0] == generated(model, PROMPTS[0], NEW)
    in_use = sum(p.in_use for p in engine.target.cache.pool_pages())
    scratch = sum(p.in_use for p in kvhf.Engine(model, max_seqs=2, capacity=32, verify=False)
                  .target.cache.pool_pages())
    assert in_use == scratch            # every sequence's pages given back
    again = engine.generate([PROMPTS[1]], max_new_tokens=NEW)
    assert again == [generated(model, PROMPTS[1], NEW)]
