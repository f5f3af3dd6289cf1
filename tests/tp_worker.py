"""The script `test_hf_tp` runs on every rank under torchrun: a tiny Llama split over the
ranks by its tensor-parallel plan and served through `kvnumba.hf.Engine`, refusals of
what the ranks cannot serve, the divergence check against a perturbed rank, steps that
fail (on every rank, on one rank before its forward, in the draft), the command line,
then the ranks' failures that end a job: the model failing on one rank inside its
forward, and a rank that exits. Each rank writes what it saw to `OUT/rank<r>.json`
(rank 1 before it exits).

    torchrun --standalone --nproc-per-node 2 tests/tp_worker.py MODEL DRAFT ONE_KV_HEAD LATENT OUT

(directories of the model, of a draft with its vocabulary and shape, of a model with one kv
head, of a DeepSeek-V3 model (latent attention); the directory for the JSON files).

One job checks it all: starting ranks (torch, transformers and kvnumba imported in each)
is most of its time.
"""
import contextlib
import io
import json
import os
import sys
import time
from datetime import timedelta

#: the requests: the first alone for a step, then the second, whose first page the first
#: has registered by then (pages of 8), with two forks beside it
PROMPTS = [[1, 5, 9, 3, 7, 4, 2, 8, 6], [1, 5, 9, 3, 7, 4, 2, 8, 8, 1]]
NEW_TOKENS = 3
SIZES = dict(max_seqs=3, capacity=24, max_write=8, dtype="float32", page_size=8)
#: seconds the model's collectives wait (the process group's timeout), and the lockstep's
MODEL_TIMEOUT, RANK_TIMEOUT = 10, 60


def counting_caches(kv) -> list:
    """A list that gains an entry for each cache made from now on."""
    made = []
    make = kv.BatchedSequenceCache.__init__

    def counted(self, *args, **kwargs):
        made.append(type(self).__name__)
        make(self, *args, **kwargs)
    kv.BatchedSequenceCache.__init__ = counted
    return made


def faulty(module, exc: BaseException):
    """`module`'s next forward raises `exc` (a hook before it runs); returns the hook."""
    def fault(module, args):
        hook.remove()
        raise exc
    hook = module.register_forward_pre_hook(fault)
    return hook


def failed_step(engine, prompt: list, more: list, error) -> dict:
    """What a failing step of `engine` (serving `prompt`) raised on this rank, and then
    what the engine held and how it served the request `more`."""
    try:
        engine.generate([prompt], max_new_tokens=1)
        raised = None
    except error as exc:
        raised = [type(exc).__name__, str(exc).splitlines()[0],
                  list(getattr(exc, "failed_requests", ()))]
    return {"raised": raised, "busy": engine.busy,
            "served next": engine.generate([more], max_new_tokens=NEW_TOKENS),
            "sessions": len(engine.target.table.sessions)}


def main(model_dir: str, draft_dir: str, one_kv_head_dir: str, latent_dir: str,
         out: str) -> None:
    started = time.perf_counter()
    os.environ.setdefault("KVNUMBA_DEVICE", "simulator")
    import torch
    import torch.distributed as dist
    import transformers

    import kvnumba as kv
    from kvnumba import device
    from kvnumba.hf import Engine, cli
    from kvnumba.hf.sharding import split_loading
    if device.SIMULATOR:
        sys.setswitchinterval(device.SIMULATOR_SWITCH_INTERVAL)
    transformers.utils.logging.disable_progress_bar()
    dist.init_process_group("gloo", timeout=timedelta(seconds=MODEL_TIMEOUT))
    load = transformers.AutoModelForCausalLM.from_pretrained
    model = load(model_dir, **split_loading()).eval()
    rank = dist.get_rank()
    seen = {"rank": rank, "ranks": dist.get_world_size()}

    # refusals: a kv head the ranks cannot share, a draft not split as the model is
    made = counting_caches(kv)
    refused = {}
    for case, served, draft in (("kv heads", load(one_kv_head_dir, **split_loading()), None),
                                ("draft", model, load(model_dir).eval())):
        try:
            Engine(served, draft_model=draft, **SIZES)
        except kv.ConfigError as exc:
            refused[case] = str(exc)
    seen["refused"], seen["caches made by the refusals"] = refused, len(made)

    # continuous batching with forks, a prefix-cache hit and a draft the model mostly
    # rejects (rewinds), every step's tables checked across the ranks
    draft = load(draft_dir, **split_loading()).eval()
    engine = Engine(model, draft_model=draft, draft_len=2, check_ranks=True,
                    rank_timeout=RANK_TIMEOUT, **SIZES)
    seen["caches made"], seen["kv heads per rank"] = len(made), engine.config.n_kv_heads
    first = engine.submit(PROMPTS[0], max_new_tokens=NEW_TOKENS)
    done = dict(engine.step())
    second = engine.submit(PROMPTS[1], max_new_tokens=NEW_TOKENS, n=2)
    while engine.busy:
        done.update(engine.step())
    seen["served"] = [done[first], done[second]]
    seen["steps checked"] = engine.lockstep.steps
    seen["cached tokens"] = engine.stats.cached_tokens
    seen["drafts"] = dict(proposed=engine.proposed, accepted=engine.accepted)

    # a step failing in the draft's forward on every rank ends its request on every rank,
    # and the engine serves the next exactly
    oom = torch.cuda.OutOfMemoryError
    faulty(draft.model.layers[0], oom("out of memory in the draft (injected)"))
    seen["draft failed"] = failed_step(engine, PROMPTS[0], PROMPTS[1], oom)

    # latent attention: every rank holds the latent whole, attends its share of the heads
    latent = load(latent_dir, **split_loading()).eval()
    engine = Engine(latent, check_ranks=True, **SIZES)
    seen["latent layer"] = engine.config.layers[0].describe()
    seen["latent served"] = engine.generate([PROMPTS[1]], max_new_tokens=NEW_TOKENS, n=2)

    # the divergence check: rank 1's cache changed behind its engine's back
    engine = Engine(model, check_ranks=True, **SIZES)
    if rank == 1:
        engine.target.table.open()
    try:
        engine.generate([PROMPTS[0]], max_new_tokens=1)
    except kv.RankDivergenceError as exc:
        seen["divergence"] = str(exc)

    # a step failing on every rank in the forward (the same fault on each), then one
    # failing on rank 1 alone as it prepares its step, before the forward: each ends its
    # request on every rank, every rank raising the same exception, and the engine serves
    # the next exactly
    engine = Engine(model, check_ranks=True, rank_timeout=RANK_TIMEOUT, **SIZES)
    faulty(model.model.layers[0], oom("out of memory (injected)"))
    seen["failed"] = failed_step(engine, PROMPTS[0], PROMPTS[1], oom)
    if rank == 1:
        cache, prepare = engine.target.cache, engine.target.cache.prepare_step

        def preparing(*args, **kwargs):
            cache.prepare_step = prepare
            raise oom("out of memory preparing the step on rank 1 (injected)")
        cache.prepare_step = preparing
    seen["failed on rank 1"] = failed_step(engine, PROMPTS[0], PROMPTS[1], oom)

    # the command line: served on every rank, printed by rank 0
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        seen["cli status"] = cli.main(["--model", model_dir, "--ignore-eos",
                                       "--ids", ",".join(map(str, PROMPTS[0])),
                                       "--max-new-tokens", str(NEW_TOKENS)])
    seen["cli printed"] = printed.getvalue()

    # the model failing on rank 1 alone inside its forward: rank 0 waits in the model's
    # all-reduce until the process group's timeout, then every rank raises
    # RankFailureError, as every later step does
    engine = Engine(model, rank_timeout=RANK_TIMEOUT, **SIZES)
    if rank == 1:
        faulty(model.model.layers[0], ValueError("rank 1's forward failed (injected)"))
    started_step = time.perf_counter()
    for case in ("forward failed on rank 1", "after"):
        try:
            engine.generate([PROMPTS[0]], max_new_tokens=1)
        except kv.RankFailureError as exc:
            seen[case] = [str(exc), round(time.perf_counter() - started_step, 1)]

    # a rank that exits: rank 0's next step raises RankFailureError, without waiting for
    # the lockstep's timeout
    engine = Engine(model, verify=False, rank_timeout=RANK_TIMEOUT, **SIZES)
    if rank == 1:
        write(seen, out, started)
        os._exit(0)
    started_step = time.perf_counter()
    try:
        engine.generate([PROMPTS[0]], max_new_tokens=1)
    except kv.RankFailureError as exc:
        seen["rank 1 exited"] = [str(exc), round(time.perf_counter() - started_step, 1)]
    write(seen, out, started)
    dist.destroy_process_group()                # every group, before Python finalizes


def write(seen: dict, out: str, started: float) -> None:
    """This rank's `seen` as `OUT/rank<r>.json`, with the job's seconds so far."""
    seen["seconds"] = round(time.perf_counter() - started, 1)
    with open(os.path.join(out, f"rank{seen['rank']}.json"), "w") as file:
        json.dump(seen, file)
    print(f"rank {seen['rank']}: {seen}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
