"""The script `test_hf_tp` runs on every rank under torchrun: a tiny Llama split over the
ranks by its tensor-parallel plan and served through `kvnumba.hf.Engine`, refusals of
what the ranks cannot serve, the divergence check against a perturbed rank and the
command line. Each rank writes what it saw to `OUT/rank<r>.json`.

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

#: the requests: the first alone for a step, then the second, whose first page the first
#: has registered by then (pages of 8), with two forks beside it
PROMPTS = [[1, 5, 9, 3, 7, 4, 2, 8, 6], [1, 5, 9, 3, 7, 4, 2, 8, 8, 1]]
NEW_TOKENS = 3
SIZES = dict(max_seqs=3, capacity=24, max_write=8, dtype="float32", page_size=8)


def counting_caches(kv) -> list:
    """A list that gains an entry for each cache made from now on."""
    made = []
    make = kv.BatchedSequenceCache.__init__

    def counted(self, *args, **kwargs):
        made.append(type(self).__name__)
        make(self, *args, **kwargs)
    kv.BatchedSequenceCache.__init__ = counted
    return made


def main(model_dir: str, draft_dir: str, one_kv_head_dir: str, latent_dir: str,
         out: str) -> None:
    started = time.perf_counter()
    os.environ.setdefault("KVNUMBA_DEVICE", "simulator")
    import torch.distributed as dist
    import transformers

    import kvnumba as kv
    from kvnumba import device
    from kvnumba.hf import Engine, cli
    from kvnumba.hf.sharding import split_loading
    if device.SIMULATOR:
        sys.setswitchinterval(device.SIMULATOR_SWITCH_INTERVAL)
    transformers.utils.logging.disable_progress_bar()
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
    engine = Engine(model, draft_model=draft, draft_len=2, check_ranks=True, **SIZES)
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

    # the command line: served on every rank, printed by rank 0
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        seen["cli status"] = cli.main(["--model", model_dir, "--ignore-eos",
                                       "--ids", ",".join(map(str, PROMPTS[0])),
                                       "--max-new-tokens", str(NEW_TOKENS)])
    seen["cli printed"] = printed.getvalue()
    seen["seconds"] = round(time.perf_counter() - started, 1)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump(seen, file)
    print(f"rank {rank}: {seen}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
