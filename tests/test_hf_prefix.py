"""The engine's prefix cache (contract §13, §14): requests sharing a prompt prefix reuse
its pages across requests and over time, and the output stays `model.generate()`'s
token for token (greedy, float32 storage) on flat and sliding-window models (Mistral's
window and Gemma-2's are smaller than the shared part), under a pool small enough to
evict between requests, with forks and with a draft model."""
import pytest

import kvnumba as kv
from hfmodels import SYSTEM, generated, kvhf, tiny

QUESTIONS = [[11, 12], [13, 14, 15], [16]]
PROMPTS = [SYSTEM + q for q in QUESTIONS]
NEW = 2


@pytest.mark.parametrize("arch", ["gemma2", "llama"])
def test_requests_sharing_a_system_prompt_hit_and_match_generate(arch):
    """(Gemma-2: windows shorter than the shared part beside a full layer; Llama: flat.)
    The first request computes the shared part; the next, submitted after it
    finished, hits its last whole page (16 of 17 tokens) and generates the same tokens
    (and so does an engine without the prefix cache)."""
    model = tiny(arch)
    want = [generated(model, p, 2) for p in PROMPTS[:2]]
    engine = kvhf.Engine(model, verify=False, max_seqs=1, capacity=32, max_write=8, dtype="float32",
                         page_size=8)
    assert [engine.generate([p], max_new_tokens=2)[0] for p in PROMPTS[:2]] == want
    stats = engine.stats
    assert (stats.prompt_tokens, stats.cached_tokens) == (len(PROMPTS[0]) + len(PROMPTS[1]),
                                                          16)
    if arch == "llama":
        off = kvhf.Engine(model, verify=False, max_seqs=1, capacity=32, max_write=8, dtype="float32",
                          page_size=8, prefix_cache=False)
        assert [off.generate([p], max_new_tokens=2)[0] for p in PROMPTS[:2]] == want
        assert off.stats.cached_tokens == 0


def test_a_request_waits_for_the_prefix_a_running_one_is_computing():
    """Submitted together: the second request is admitted once the first has prefilled
    the pages they share, and hits them, rather than compute them beside it."""
    model = tiny("llama")
    want = [generated(model, p, NEW) for p in PROMPTS[:2]]
    engine = kvhf.Engine(model, verify=False, max_seqs=2, capacity=32, max_write=8, dtype="float32",
                         page_size=8)
    assert engine.generate(PROMPTS[:2], max_new_tokens=NEW) == want
    assert engine.stats.cached_tokens == 16


def test_a_conversation_turn_reuses_the_previous_turn_and_its_answer():
    model = tiny("mistral")
    engine = kvhf.Engine(model, verify=False, max_seqs=1, capacity=40, max_write=8, dtype="float32",
                         page_size=8)
    first = SYSTEM[:10]
    answer = engine.generate([first], max_new_tokens=8)[0]
    second = first + answer + [21, 22]                # 20 tokens: 2 whole pages indexed
    assert engine.generate([second], max_new_tokens=NEW)[0] == generated(model, second, NEW)
    assert engine.stats.cached_tokens == 16


def test_evictions_between_requests_keep_the_output():
    """A pool of 5 flat pages (4 besides the scratch page), one sequence: the first
    request (19 + 3 positions: 3 pages) leaves 2 cached; an unrelated one evicts the
    first's deepest page for its third; the third request hits the first's remaining
    page and evicts the unrelated one's deepest for its own."""
    model = tiny("llama")
    prompts = [PROMPTS[0], list(range(40, 59)), PROMPTS[2]]
    want = [generated(model, p, NEW) for p in prompts]
    engine = kvhf.Engine(model, verify=False, max_seqs=1, capacity=32, max_write=8, dtype="float32",
                         page_size=8, max_pages=5)
    assert [engine.generate([p], max_new_tokens=NEW)[0] for p in prompts] == want
    assert engine.stats.pages_evicted == 2 and engine.stats.cached_tokens == 8


def test_forks_and_a_draft_model_share_the_index():
    """n = 2 forks of requests that hit, with a draft model whose own cache hits too."""
    model = tiny("llama")
    draft = tiny("llama", seed=1)
    want = [generated(model, p, 2) for p in PROMPTS[:2]]
    engine = kvhf.Engine(model, verify=False, max_seqs=2, capacity=32, max_write=8, dtype="float32",
                         page_size=8, draft_model=draft, draft_len=2)
    assert engine.generate(PROMPTS[:1], max_new_tokens=2) == want[:1]
    assert engine.generate(PROMPTS[1:2], max_new_tokens=2, n=2) == [want[1]] * 2
    assert engine.stats.cached_tokens == 16
    assert engine.draft.table.prefix_stats.tokens_hit == 16


def test_an_extra_key_keeps_requests_apart():
    model = tiny("llama")
    engine = kvhf.Engine(model, verify=False, max_seqs=1, capacity=32, max_write=8, dtype="float32",
                         page_size=8, max_pages=9)          # room for both tenants' pages
    engine.generate(PROMPTS[:1], max_new_tokens=1, extra_key="tenant-a")
    engine.generate(PROMPTS[1:2], max_new_tokens=1, extra_key="tenant-b")
    assert engine.stats.cached_tokens == 0
    engine.generate(PROMPTS[2:], max_new_tokens=1, extra_key="tenant-a")
    assert engine.stats.cached_tokens == 16
    with pytest.raises(kv.ConfigError, match="extra_key"):
        engine.submit(PROMPTS[0], max_new_tokens=1, extra_key=5)
    assert not engine.busy
