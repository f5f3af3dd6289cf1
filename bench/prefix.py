"""Prefix reuse (contract §14): prompt tokens computed, pages held and the share of each
prompt served from the prefix index, with reuse on and off; host µs per page looked up
and per page registered.

A control-plane serving loop (no model: each step declares, prepares and commits
positions and writes no K/V) runs requests through a `SessionTable` over a
`BatchedSequenceCache`, with continuous batching: up to `max_running` requests at once,
each step one input per running request, a prefill chunk of at most `max_write` prompt
tokens or one decode token. A request's last prompt chunk yields its first new token,
each decode step the next; the last new token is not fed back (a request of `p` prompt
tokens and `n` new tokens commits `p + n - 1` positions). Token ids are deterministic:
prompts are arithmetic sequences of a seed, and a decoded token is a function of the
token before it and its position (so identical sequences decode alike, as greedy
decoding does).

* reuse on: a request opens its session from its prompt (`SessionTable.open(prompt)`:
  the longest indexed prefix, whole pages, never the last token) and registers its
  committed pages after every step (`SessionTable.register`). A waiting request whose
  next page to compute is one a running request is still prefilling (by its page key
  after `prefix_match`) waits until that page is registered rather than compute it too;
  so the first request computes a shared prompt and the others share its pages.
* reuse off: sessions open empty and register nothing; nothing waits.

Workloads, each on three layer configs (1 kv head, head_dim 8, float16, pages of 16:
memory is trivial, and the counts do not depend on the shape): Llama-like, flat layers
only; Gemma-2-like, a ring layer (window 256) and a flat layer alternating;
Qwen3-Next-like, three state layers (contract §17: a match ends at the deepest page the
index holds a state snapshot of) and a flat layer; and Granite-4-like, nine Mamba-2
state layers to a flat layer (Granite-4.0-H-Tiny's 36 to 4):

* shared system prompt: 64 requests of a 1,024-token system prompt and a distinct
  64-token question, 8 new tokens each, up to 16 running, chunks of 256: prompt tokens
  computed (prefilled), and the peak of the pages live sequences hold (`pool_pages`:
  `in_use` less the scratch page, per layer kind, summed), and of those plus the pages
  the index alone holds (`cached`, reclaimable);
* multi-turn: 8 conversations of 4 turns, interleaved (all running at once), a
  conversation's turns one after another: turn 1's prompt is the system prompt and a
  user message, each later turn's the previous prompt, its answer and a new user
  message; user messages and answers of 32 ± 4 tokens. A turn registers its prompt and
  its output as they are committed and closes its session when it ends. The share of
  each turn's prompt tokens served from the index, per turn.

Host time (flat layers only: no ring rows to copy): µs per page of looking up the 64
pages of a 1,024-token prompt (`prefix_match`, `seq_from_prefix`, `SessionTable.open`)
and of registering a 1,024-position sequence's 64 pages (`prefix_register`,
`SessionTable.register`), best of a few repeats.

On the simulator the device work (uploads, page-table patches, ring row copies) is
replaced by no-ops, as in the control-plane bench (`control.device_work`): it changes
no count, and the host times are host work alone; on a GPU it runs.

    python -m kvnumba.bench.prefix [--quick] [--json PATH]
"""
from __future__ import annotations

import dataclasses
import gc
import time

import numpy as np

import kvnumba as kv
import kvnumba.device as kv_device

from .command import section_main
from .control import DEVICE_WORK, device_work

HEADER = "Prefix reuse (prefix index, contract §14)"
VOCAB = 32000
TARGET_COMPUTED = 0.10      # prompt tokens computed, on over off (Llama-like)
TARGET_HELD = 0.15          # peak pages held by sequences, on over off (Llama-like)
TARGET_SHARE = 0.90         # share of a turn's prompt served from the index, turns 2 on


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The workloads' sizes (module doc)."""

    requests: int = 64
    system: int = 1024
    question: int = 64
    new_tokens: int = 8
    max_running: int = 16
    conversations: int = 8
    turns: int = 4
    user: int = 32
    answer: int = 32
    jitter: int = 4             # user messages and answers: user / answer ± jitter tokens
    max_write: int = 256
    window: int = 256
    page_size: int = 16
    lookup: int = 1024          # tokens of the prompt the host times look up and register

    @property
    def capacity(self) -> int:
        """Positions a session may reach, rounded up to whole pages."""
        longest = max(self.system + self.question + self.new_tokens, self.lookup + 1,
                      self.system + self.turns * (self.user + self.answer + 2 * self.jitter))
        return -(-longest // self.page_size) * self.page_size

    def layer_configs(self) -> dict:
        return {"flat": [kv.flat(), kv.flat()],
                "windowed": [kv.ring(window=self.window), kv.flat()],
                "hybrid": [HYBRID_STATE] * 3 + [kv.flat()],
                "granite": [MAMBA2_STATE] * 9 + [kv.flat()]}


FULL = Sizes()
#: a Qwen3-Next-like layer of the hybrid config: a gated-delta-rule mixer's conv window
#: and recurrent state (small: the counts do not depend on its shape)
HYBRID_STATE = kv.state(conv=(24, 4), recurrent=(1, 8, 8))
#: a Mamba-2 layer of the Granite-4-like config: the conv window over x, B and C (2 heads
#: of 8, one group of state 8) and the state `[heads, d_state, head_dim]` (small as above)
MAMBA2_STATE = kv.state(conv=(2 * 8 + 2 * 8, 4), recurrent=(2, 8, 8))
LAYER_NAMES = {"flat": "Llama-like: 2 flat layers",
               "windowed": "Gemma-2-like: ring (W {window}) + flat",
               "hybrid": "Qwen3-Next-like: 3 state layers + flat",
               "granite": "Granite-4-like: 9 Mamba-2 + flat"}


# ---------------------------------------------------------------------------- tokens
def text(seed: int, n: int) -> np.ndarray:
    """`n` token ids of seed `seed` (int64): two seeds apart by less than VOCAB differ at
    every position (1,000,003 is prime to VOCAB)."""
    return (seed * 1_000_003 + np.arange(n, dtype=np.int64) * 7_919) % VOCAB


def next_token(last: int, position: int) -> int:
    """The token decoded after `last`, the token at `position - 1`."""
    return (last * 31 + position * 7 + 1) % VOCAB


def jittered(base: int, jitter: int, *salt: int) -> int:
    """`base` ± `jitter`, deterministically from `salt`."""
    return base + (sum((i + 3) * s for i, s in enumerate(salt)) % (2 * jitter + 1)) - jitter


# ---------------------------------------------------------------------------- serving
@dataclasses.dataclass(eq=False)
class Request:
    """One request: its prompt, the tokens it generates, and what serving it took."""

    prompt: np.ndarray
    new_tokens: int
    tag: tuple = ()
    sid: object = None
    keys: list | None = None         # page keys of prompt[:-1] (reuse on)
    tokens: list = dataclasses.field(default_factory=list)   # prompt, then new tokens
    fed: int = 0                     # positions its session holds
    hit: int = 0                     # prompt tokens served from the index
    computed: int = 0                # prompt tokens prefilled

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prompt.size

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt.size >= self.new_tokens


def cache_config(layers, sizes: Sizes, max_running: int) -> kv.CacheConfig:
    """The cache of a server of `max_running` requests at once (module doc)."""
    return kv.CacheConfig(layers=layers, n_kv_heads=1, head_dim=8, capacity=sizes.capacity,
                          max_seqs=max_running, max_write=sizes.max_write,
                          max_step=max_running * sizes.max_write, dtype="float16",
                          page_size=sizes.page_size)


class Server:
    """The control-plane serving loop (module doc) over one cache and session table.

    `on_finish(request)`: called as a request ends (its session closed), to submit more."""

    def __init__(self, layers, sizes: Sizes, *, reuse: bool, max_running: int,
                 on_finish=None):
        self.cache = kv.BatchedSequenceCache(cache_config(layers, sizes, max_running))
        self.table = kv.SessionTable(self.cache, max_sessions=max_running,
                                     max_session_tokens=sizes.capacity)
        self.reuse, self.max_running, self.max_write = reuse, max_running, sizes.max_write
        self.page_size = sizes.page_size
        self.on_finish = on_finish
        self.waiting: list = []
        self.running: list = []
        self.finished: list = []
        self.steps = 0
        self.peak_held = self.peak_footprint = 0

    def submit(self, request: Request) -> None:
        self.waiting.append(request)

    def run(self) -> Server:
        while self.waiting or self.running:
            self.admit()
            if not self.running:
                raise RuntimeError("prefix bench: requests wait with none running")
            self.step()
        return self

    def pages(self) -> tuple:
        """(pages live sequences hold, pages the index alone holds), over layer kinds."""
        pools = self.cache.pool_pages()
        return sum(p.in_use - 1 for p in pools), sum(p.cached for p in pools)

    def _note_pages(self) -> None:
        held, cached = self.pages()
        self.peak_held = max(self.peak_held, held)
        self.peak_footprint = max(self.peak_footprint, held + cached)

    def _waits(self, request: Request) -> bool:
        """Whether the next page `request` would compute is one a running request is
        still prefilling (it waits for that page to be registered)."""
        if request.keys is None:
            request.keys = kv.page_keys(request.prompt[:-1], self.page_size)
        matched = self.cache.prefix_match(request.keys)
        if matched == len(request.keys):
            return False
        key = request.keys[matched]
        return any(r.prefilling and key in r.keys for r in self.running)

    def admit(self) -> None:
        """Open sessions for waiting requests, in order, while there is room."""
        for request in list(self.waiting):
            if len(self.running) >= self.max_running:
                break
            if self.reuse:
                if self._waits(request):
                    continue
                sid = self.table.open(request.prompt)
            else:
                sid = self.table.open()
            self.waiting.remove(request)
            request.sid, request.tokens = sid, request.prompt.tolist()
            request.hit = request.fed = self.table.pos(sid)
            self.running.append(request)
        self._note_pages()

    def step(self) -> None:
        """One step: a prefill chunk or a decode token per running request, committed;
        then new tokens, registrations (reuse on) and the requests that ended."""
        inputs = []
        for r in self.running:
            end = min(r.fed + self.max_write, r.prompt.size) if r.prefilling else r.fed + 1
            inputs.append((r.sid, r.fed, np.asarray(r.tokens[r.fed:end], np.int64)))
        packed = self.table.pack(inputs)
        cache = self.cache
        cache.declare_step(packed.seq_ids)
        cache.prepare_step()
        cache.commit_step()
        self.steps += 1
        for r, (_, _, chunk) in zip(self.running, inputs):
            if r.prefilling:
                r.computed += chunk.size
            r.fed += chunk.size
            if r.fed == len(r.tokens):           # its last token's logits: a new token
                r.tokens.append(next_token(r.tokens[-1], r.fed))
            if self.reuse:
                self.table.register(r.sid, r.tokens)
        self._note_pages()
        for r in [r for r in self.running if r.done]:
            self.table.close(r.sid)
            self.running.remove(r)
            self.finished.append(r)
            if self.on_finish is not None:
                self.on_finish(r)


# ---------------------------------------------------------------------------- workloads
def shared_prompt(layers, sizes: Sizes, reuse: bool) -> dict:
    """`sizes.requests` requests of the system prompt and a distinct question each."""
    system = text(0, sizes.system)
    server = Server(layers, sizes, reuse=reuse, max_running=sizes.max_running)
    for i in range(sizes.requests):
        question = text(1 + i, sizes.question)
        server.submit(Request(np.concatenate([system, question]), sizes.new_tokens, (i,)))
    server.run()
    stats = server.table.prefix_stats
    return dict(prompt_tokens=sum(r.prompt.size for r in server.finished),
                computed=sum(r.computed for r in server.finished),
                hit=sum(r.hit for r in server.finished), peak_held=server.peak_held,
                peak_with_cached=server.peak_footprint, cached_at_end=server.pages()[1],
                steps=server.steps, pages_evicted=stats.pages_evicted,
                hit_rate=stats.hit_rate)


def conversations(layers, sizes: Sizes, reuse: bool) -> dict:
    """`sizes.conversations` conversations of `sizes.turns` turns each, interleaved."""
    system = text(0, sizes.system)
    server = None

    def user(conv: int, turn: int) -> np.ndarray:
        n = jittered(sizes.user, sizes.jitter, conv, turn)
        return text(1000 + conv * sizes.turns + turn, n)

    def turn_request(conv: int, turn: int, before: np.ndarray) -> Request:
        answer = jittered(sizes.answer, sizes.jitter, conv, turn, 1)
        return Request(np.concatenate([before, user(conv, turn)]), answer, (conv, turn))

    def next_turn(done: Request) -> None:
        conv, turn = done.tag
        if turn + 1 < sizes.turns:
            server.submit(turn_request(conv, turn + 1, np.asarray(done.tokens, np.int64)))

    server = Server(layers, sizes, reuse=reuse, max_running=sizes.conversations,
                    on_finish=next_turn)
    for conv in range(sizes.conversations):
        server.submit(turn_request(conv, 0, system))
    server.run()
    turns = []
    for turn in range(sizes.turns):
        of_turn = [r for r in server.finished if r.tag[1] == turn]
        prompt = sum(r.prompt.size for r in of_turn)
        hit = sum(r.hit for r in of_turn)
        turns.append(dict(turn=turn + 1, prompt_tokens=prompt, hit=hit,
                          computed=sum(r.computed for r in of_turn), share=hit / prompt))
    return dict(turns=turns, computed=sum(t["computed"] for t in turns),
                prompt_tokens=sum(t["prompt_tokens"] for t in turns), steps=server.steps,
                peak_held=server.peak_held, peak_with_cached=server.peak_footprint,
                pages_evicted=server.table.prefix_stats.pages_evicted)


# ---------------------------------------------------------------------------- host time
def _best_us(call, repeats: int, inner: int = 1, reset=None) -> float:
    """Best µs of `call()` over `repeats` blocks of `inner` calls each, `reset()` (untimed)
    after each block; the garbage collector off while timing."""
    best = float("inf")
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(inner):
                call()
            best = min(best, (time.perf_counter() - start) / inner)
            if reset is not None:
                reset()
    finally:
        if gc_was:
            gc.enable()
    return best * 1e6


def host_times(sizes: Sizes, repeats: int) -> dict:
    """µs per page of lookups and registrations of a `sizes.lookup`-token prompt's pages,
    flat layers only (module doc)."""
    server = Server(sizes.layer_configs()["flat"], sizes, reuse=True, max_running=2)
    cache, table, size = server.cache, server.table, sizes.page_size
    prompt = text(0, sizes.lookup)
    keys = kv.page_keys(prompt, size)
    n = len(keys)

    def filled_session():
        sid = table.open()
        for at in range(0, prompt.size, sizes.max_write):
            packed = table.pack([(sid, at, prompt[at:at + sizes.max_write])])
            cache.declare_step(packed.seq_ids)
            cache.prepare_step()
            cache.commit_step()
        return sid

    sid = filled_session()
    seq = table.seq(sid)
    register_us = _best_us(lambda: cache.prefix_register(seq, keys), repeats,
                           reset=cache.prefix_clear)
    table.close(sid)

    sessions = []

    def register_fresh():
        sessions.append(filled_session())

    def forget():
        table.close(sessions.pop())
        cache.prefix_clear()
        register_fresh()

    register_fresh()
    table_register_us = _best_us(lambda: table.register(sessions[-1], prompt), repeats,
                                 reset=forget)
    assert cache.prefix_match(keys) == 0          # the last reset cleared it
    table.register(sessions[-1], prompt)
    table.close(sessions.pop())
    assert cache.prefix_match(keys) == n           # cached: the index alone holds them

    opened = []
    longer = np.concatenate([prompt, text(1, 1)])  # every page looked up, one token more
    match_us = _best_us(lambda: cache.prefix_match(keys), repeats, inner=100)
    keys_us = _best_us(lambda: kv.page_keys(prompt, size), repeats, inner=10)
    share_us = _best_us(lambda: opened.append(cache.seq_from_prefix(keys)), repeats,
                        reset=lambda: cache.seq_rm(opened.pop()))
    open_us = _best_us(lambda: opened.append(table.open(longer)), repeats,
                       reset=lambda: table.close(opened.pop()))
    return dict(pages=n, tokens=int(prompt.size), repeats=repeats, rows=[
        dict(op="prefix_match", what="lookup, keys given", us_per_page=match_us / n),
        dict(op="seq_from_prefix", what="lookup and share, keys given",
             us_per_page=share_us / n),
        dict(op="SessionTable.open(prompt)", what="page keys, lookup and share",
             us_per_page=open_us / n),
        dict(op="page_keys", what="BLAKE2b page keys", us_per_page=keys_us / n),
        dict(op="prefix_register", what="register, keys given", us_per_page=register_us / n),
        dict(op="SessionTable.register", what="page keys and register",
             us_per_page=table_register_us / n)])


# ---------------------------------------------------------------------------- run, report
def run(quick: bool = False, sizes: Sizes = FULL) -> dict:
    """The counts of both workloads on both layer configs, reuse on and off, and the host
    times; the figures as a dict."""
    start = time.perf_counter()
    configs = sizes.layer_configs()
    with device_work():
        shared = {name: {mode: shared_prompt(layers, sizes, mode == "on")
                         for mode in ("off", "on")} for name, layers in configs.items()}
        turns = {name: {mode: conversations(layers, sizes, mode == "on")
                        for mode in ("off", "on")} for name, layers in configs.items()}
        host = host_times(sizes, 3 if quick else 20)
    for by_mode in shared.values():
        on, off = by_mode["on"], by_mode["off"]
        by_mode["computed_ratio"] = on["computed"] / off["computed"]
        by_mode["held_ratio"] = on["peak_held"] / off["peak_held"]
    flat = shared["flat"]
    later = [t["share"] for name in turns for t in turns[name]["on"]["turns"][1:]]
    ring_rows = int(cache_config(configs["windowed"], sizes, 1).ring_rows().max())
    return dict(device=kv_device.KIND, device_work=DEVICE_WORK[kv_device.KIND], quick=quick,
                sizes=dataclasses.asdict(sizes), ring_rows=ring_rows,
                ring_pages=-(-ring_rows // sizes.page_size), shared_prompt=shared,
                conversations=turns,
                host=host, targets=dict(computed=TARGET_COMPUTED, held=TARGET_HELD,
                                        share=TARGET_SHARE),
                meets_computed_target=flat["computed_ratio"] <= TARGET_COMPUTED,
                meets_held_target=flat["held_ratio"] <= TARGET_HELD,
                min_later_share=min(later) if later else None,
                meets_share_target=bool(later) and min(later) >= TARGET_SHARE,
                seconds=time.perf_counter() - start)


def _layers(name: str, sizes: dict) -> str:
    return LAYER_NAMES[name].format(**sizes)


def report(result: dict) -> str:
    s = result["sizes"]
    ok = {True: "met", False: "MISSED"}
    lines = [f"{HEADER}: a control-plane serving loop (positions only, no K/V), "
             f"deterministic counts; device work {result['device_work']}",
             f"  1 kv head, head_dim 8, float16, pages of {s['page_size']}, prefill chunks "
             f"<= {s['max_write']} tokens; reuse on: open from the prompt, register after "
             f"each commit, wait for a page another request is prefilling; off: neither",
             f"  shared system prompt: {s['requests']} requests of a {s['system']:,}-token "
             f"system prompt + a distinct {s['question']}-token question, {s['new_tokens']} "
             f"new tokens each, up to {s['max_running']} running",
             f"  {'layers':<38} {'reuse':<5} {'prompt computed':>16} {'ratio':>7} "
             f"{'peak pages held':>15} {'ratio':>7} {'+ cached':>8} {'steps':>6}"]
    for name, by_mode in result["shared_prompt"].items():
        for mode in ("off", "on"):
            f = by_mode[mode]
            ratios = (f"{by_mode['computed_ratio']:>6.3f}x", f"{by_mode['held_ratio']:>6.3f}x") \
                if mode == "on" else ("", "")
            label = _layers(name, s) if mode == "off" else ""
            lines.append(f"  {label:<38} {mode:<5} {f['computed']:>16,} {ratios[0]:>7} "
                         f"{f['peak_held']:>15,} {ratios[1]:>7} {f['peak_with_cached']:>8,} "
                         f"{f['steps']:>6}")
    flat = result["shared_prompt"]["flat"]
    lines.append(f"  Llama-like: prompt tokens computed {flat['computed_ratio']:.3f}x (target <= "
                 f"{TARGET_COMPUTED}: {ok[result['meets_computed_target']]}), peak pages held "
                 f"{flat['held_ratio']:.3f}x (target <= {TARGET_HELD}: "
                 f"{ok[result['meets_held_target']]}); '+ cached': with the pages the index "
                 f"alone holds (reclaimable)")
    if "windowed" in result["shared_prompt"]:
        lines.append(f"  Gemma-2-like: every running request holds its ring "
                     f"({result['ring_pages']} pages of {result['ring_rows']} rows) with reuse "
                     f"on or off; the index "
                     f"keeps a registered page's ring rows in a page of its own (cached)")
    conv = result["conversations"]
    lines += [f"  multi-turn: {s['conversations']} conversations x {s['turns']} turns, "
              f"interleaved; turn 1 = the system prompt + a user message, then the previous "
              f"prompt + its answer + a user message ({s['user']} ± {s['jitter']} and "
              f"{s['answer']} ± {s['jitter']} tokens)",
              f"  {'turn':>6} {'prompt tokens':>14} " +
              " ".join(f"{'from index, ' + name:>20}" for name in conv)]
    for i in range(s["turns"]):
        t0 = conv[next(iter(conv))]["on"]["turns"][i]
        lines.append(f"  {i + 1:>6} {t0['prompt_tokens']:>14,} " + " ".join(
            f"{conv[name]['on']['turns'][i]['share']:>20.1%}" for name in conv))
    computed = ", ".join(f"{name} {conv[name]['on']['computed']:,} of "
                         f"{conv[name]['off']['computed']:,} "
                         f"({conv[name]['on']['computed'] / conv[name]['off']['computed']:.3f}x)"
                         for name in conv)
    lines.append(f"  prompt tokens computed, on of off: {computed}")
    if result["min_later_share"] is not None:
        lines.append(f"  served from the index from turn 2 on: at least "
                     f"{result['min_later_share']:.1%} (target >= {TARGET_SHARE:.0%}: "
                     f"{ok[result['meets_share_target']]})")
    host = result["host"]
    lines.append(f"  host µs per page, Llama-like, a {host['tokens']:,}-token prompt's "
                 f"{host['pages']} pages (best of {host['repeats']}):")
    for row in host["rows"]:
        lines.append(f"    {row['op']:<28} {row['what']:<30} {row['us_per_page']:>7.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    return section_main(argv, "python -m kvnumba.bench.prefix", __doc__, run, report,
                        "fewer timing repeats")


if __name__ == "__main__":
    raise SystemExit(main())
