"""The engine's faults that only combinations show (contract §13, §14): a draft model with
the prefix cache keeps one position per request in both caches, token for token against
`model.generate()` also under evictions; a step in which the model raises ends the
requests in it, registers nothing of it, and the engine serves the next requests
exactly; engine options combined."""
import pytest

from hfmodels import generated, kvhf, tiny

torch = pytest.importorskip("torch")

FIRST = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]          # 10 tokens; pages of 8


def test_a_draft_with_the_prefix_cache_opens_a_request_where_both_caches_hold_it():
    """The first turn's answer leaves the model's index two pages and the draft's one (the
    draft is not fed a request's last tokens). The next turn opens in both caches at the
    shorter hit (8), so the draft is fed what the model is fed: before, the draft took
    the model's chunk at its own position and the step after raised CapacityError. A
    pool of 5 pages (4 besides scratch) then evicts for an unrelated prompt."""
    model, draft = tiny("llama"), tiny("llama", seed=1)
    engine = kvhf.Engine(model, verify=False, max_seqs=1, capacity=40, max_write=8, dtype="float32",
                         page_size=8, draft_model=draft, draft_len=2, max_pages=5)
    answer = engine.generate([FIRST], max_new_tokens=7)[0]
    assert answer == generated(model, FIRST, 7)
    assert (engine.target.cache.prefix_counts.pages, engine.draft.cache.prefix_counts.pages) \
        == (2, 1)
    second = FIRST + answer + [21, 22]
    assert engine.generate([second], max_new_tokens=3)[0] == generated(model, second, 3)
    assert engine.stats.cached_tokens == engine.draft.table.prefix_stats.tokens_hit == 8
    unrelated = list(range(30, 47))
    assert engine.generate([unrelated], max_new_tokens=2)[0] == generated(model, unrelated, 2)
    assert engine.stats.pages_evicted > 0
    assert not engine.busy and not engine.target.table.sessions and \
        not engine.draft.table.sessions


class Fault:
    """A forward pre-hook on a model's first decoder layer that raises on its `at`-th call
    (counted from 1) and never again."""

    def __init__(self, model, at: int):
        self.calls, self.at = 0, at
        self.handle = model.model.layers[0].register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1
        if self.calls == self.at:
            raise torch.cuda.OutOfMemoryError("out of memory (injected)")


def indexed(served):
    """Pages in `served`'s prefix index."""
    return served.cache.prefix_counts.pages


def held(served):
    """Pages sequences hold, per layer kind, besides the scratch page."""
    return [pool.in_use - 1 for pool in served.cache.pool_pages()]


@pytest.mark.parametrize("where", ["model", "draft"])
def test_a_step_in_which_a_model_raises_ends_its_requests_and_the_engine_serves_on(where):
    model, draft = tiny("llama"), tiny("llama", seed=1)
    engine = kvhf.Engine(model, verify=False, max_seqs=2, capacity=40, max_write=8, dtype="float32",
                         page_size=8, draft_model=draft, draft_len=2)
    a = engine.submit(FIRST, max_new_tokens=4)
    engine.step()                                   # a's first chunk (8 tokens), registered
    before = indexed(engine.target), indexed(engine.draft)
    assert before == (1, 1)
    waiting = engine.submit([7] * 12, max_new_tokens=2, n=2)   # no room with a running: waits
    fault = Fault(model if where == "model" else draft, 1)
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        engine.step()                               # a's last prompt chunk (the draft's too)
    fault.handle.remove()
    assert raised.value.failed_requests == (a,)
    assert (indexed(engine.target), indexed(engine.draft)) == before  # nothing registered
    assert held(engine.target) == held(engine.draft) == [0]          # a's sequences freed
    assert engine.busy                              # the waiting request goes on
    done = {}
    while engine.busy:
        done.update(engine.step())
    assert done == {waiting: [generated(model, [7] * 12, 2)] * 2}
    assert not engine.target.table.sessions and not engine.draft.table.sessions
    assert engine.generate([FIRST], max_new_tokens=3) == [generated(model, FIRST, 3)]


def test_a_failed_generate_ends_its_other_requests_too():
    model = tiny("llama")
    engine = kvhf.Engine(model, verify=False, max_seqs=2, capacity=40, max_write=8, dtype="float32",
                         page_size=8)
    fault = Fault(model, 2)
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        engine.generate([FIRST, [4, 2, 8]], max_new_tokens=3)
    fault.handle.remove()
    assert raised.value.failed_requests and not engine.busy
    assert not engine.target.table.sessions and engine.cancel(1) is False
    assert engine.generate([[4, 2, 8]], max_new_tokens=2) == [generated(model, [4, 2, 8], 2)]


def test_cancel_ends_a_waiting_or_running_request():
    model = tiny("llama")
    engine = kvhf.Engine(model, verify=False, max_seqs=1, capacity=40, max_write=8, dtype="float32",
                         page_size=8)
    running = engine.submit(FIRST, max_new_tokens=3)
    waiting = engine.submit([4, 2, 8], max_new_tokens=2)
    engine.step()
    assert engine.cancel(waiting) and engine.cancel(running) and not engine.busy
    assert not engine.target.table.sessions and engine.cancel(running) is False


@pytest.mark.parametrize("options", [
    dict(draft=True, n=2, kv_bytes=1 << 16, dtype="float8_e4m3"),
    dict(draft=True, n=2, prefix_cache=False),
], ids=["draft-n2-kv_bytes-e4m3", "draft-n2-no-prefix"])
def test_engine_options_combined_serve_what_the_plain_engine_serves(options):
    """Each combination's greedy output over two requests sharing a page, the second
    submitted after the first finished (a prefix hit where the cache is on), equals
    the plain engine's over the same storage dtype (float32: `generate()`'s)."""
    options = dict(options)
    n, dtype = options.pop("n", 1), options.pop("dtype", "float32")
    draft = tiny("llama", seed=1) if options.pop("draft", False) else None
    model = tiny("llama")
    prompts = [FIRST, FIRST[:8] + [11, 12]]
    plain = kvhf.Engine(model, verify=False, max_seqs=2, capacity=32, max_write=8, dtype=dtype, page_size=8,
                        prefix_cache=False)
    want = [plain.generate([p], max_new_tokens=2)[0] for p in prompts]
    if dtype == "float32":
        assert want == [generated(model, p, 2) for p in prompts]
    engine = kvhf.Engine(model, verify=False, max_seqs=2, capacity=32, max_write=8, dtype=dtype,
                         page_size=8, draft_model=draft, draft_len=2, **options)
    got = [engine.generate([p], max_new_tokens=2, n=n) for p in prompts]
    assert got == [[w] * n for w in want]
    assert engine.stats.cached_tokens == (0 if options.get("prefix_cache") is False else 8)
    assert not engine.busy and not engine.target.table.sessions
