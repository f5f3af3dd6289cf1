"""Tensor-parallel serving (contract §13): a tiny Llama split over two ranks by its
tensor-parallel plan (torchrun, gloo on the CPU, the CUDA simulator), each rank's engine
(continuous batching, forks, a prefix-cache hit, a draft) against the whole model's
`model.generate()` in this process; the refusals of a kv head count the ranks cannot
share and of a draft not split as the model is, in every process and before any cache is
made; the divergence check naming a perturbed rank; the command line printing from rank 0
only. One torchrun job (`tp_worker.py`) checks all of it."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvnumba as kv
from kvnumba.hf.sharding import kv_heads_per_rank

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hfmodels import generated, tiny  # noqa: E402
from test_hf_latent import deepseek  # noqa: E402
from tp_worker import MODEL_TIMEOUT, NEW_TOKENS, PROMPTS, RANK_TIMEOUT  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RANKS = 2


def test_two_ranks_serve_what_one_process_generates(tmp_path):
    model = tiny("llama")                            # 4 query heads, 2 kv heads
    model.save_pretrained(tmp_path / "model")
    tiny("llama", seed=1).save_pretrained(tmp_path / "draft")
    tiny("llama", num_key_value_heads=1).save_pretrained(tmp_path / "one kv head")
    latent = deepseek()
    latent.save_pretrained(tmp_path / "latent")
    want = [generated(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    want_latent = generated(latent, PROMPTS[1], NEW_TOKENS)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "KVNUMBA_DEVICE": "simulator", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", str(RANKS), str(ROOT / "tests" / "tp_worker.py"),
                          str(tmp_path / "model"), str(tmp_path / "draft"),
                          str(tmp_path / "one kv head"), str(tmp_path / "latent"), str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    print(job.stdout)
    print(f"{RANKS} ranks: {time.perf_counter() - started:.1f} s")
    assert job.returncode == 0, job.stderr[-6000:]
    seen = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(RANKS)]

    for rank, saw in enumerate(seen):
        assert (saw["rank"], saw["ranks"]) == (rank, RANKS)
        # each rank's cache holds its share of the kv heads, and every rank returns the
        # whole model's greedy tokens (the forks of the second request alike), its
        # second prompt's first page from the prefix cache, a draft whose rejected
        # proposals were rewound on every rank
        assert saw["kv heads per rank"] == 1
        assert saw["served"] == [want[0], [want[1]] * 2]
        assert saw["steps checked"] >= NEW_TOKENS
        assert saw["cached tokens"] == 8
        assert saw["drafts"]["proposed"] > saw["drafts"]["accepted"]
        # refused on every rank, before any cache was made (the counter does count:
        # serving made four, the probe's cache of the model and of the draft, each run
        # on every rank in step, then the engine's two)
        assert "1 kv head and 4 query heads cannot be split over 2 ranks" in \
            saw["refused"]["kv heads"] and "serve it on 1 rank" in saw["refused"]["kv heads"]
        assert saw["refused"]["draft"].startswith(
            "draft_model: not split (1 rank), the model split over 2 ranks")
        assert saw["caches made by the refusals"] == 0 and saw["caches made"] == 4
        assert saw["divergence"].startswith("step 1: rank 1 differs from rank 0 (rank 1 in "
                                            "the model's cache")
        assert saw["cli status"] == 0
        # steps that failed on every rank (the model's forward, the draft's) or on rank 1
        # alone before its forward: each ended its request on every rank, every rank
        # raising the same exception, and the engine served the next request exactly
        for case, message in (("draft failed", "out of memory in the draft (injected)"),
                              ("failed", "out of memory (injected)"),
                              ("failed on rank 1", "out of memory preparing the step on rank "
                                                   "1 (injected)")):
            ended = saw[case]["raised"][2]
            assert len(ended) == 1 and saw[case] == {
                "raised": ["OutOfMemoryError", message, ended], "busy": False,
                "served next": [want[1]], "sessions": 0}
        # a DeepSeek-V3 model: each rank's cache holds the whole latent (one row of 32 +
        # 8 a token, as one process's), each rank attends 2 of its 4 heads
        assert saw["latent layer"] == "latent of rank 32 + 8 rope values"
        assert saw["latent served"] == [want_latent] * 2
    # the model failing inside rank 1's forward alone: rank 0 waited out the model's
    # process group's timeout, then both raised RankFailureError, and so did the next step
    for saw in seen:
        failed, seconds = saw["forward failed on rank 1"]
        assert failed.startswith("step 1: the model failed on some ranks, not on every "
                                 "rank alike (")
        assert "rank 1: ValueError: rank 1's forward failed (injected)" in failed
        assert failed.endswith("restart the job") and saw["after"][0] == failed
        assert seconds < MODEL_TIMEOUT + 30
    assert seen[0]["forward failed on rank 1"][1] >= MODEL_TIMEOUT
    # rank 1 exited: rank 0's next step raised RankFailureError without waiting out the
    # lockstep's timeout
    lost, seconds = seen[0]["rank 1 exited"]
    assert lost.startswith("step 1: the ranks lost each other (") and \
        f"rank_timeout={RANK_TIMEOUT} s" in lost
    assert seconds < RANK_TIMEOUT
    print(f"rank 1 failed in its forward: {seen[0]['forward failed on rank 1'][1]} s; "
          f"rank 1 exited: {seconds} s")
    # the command line prints on rank 0 alone
    printed = seen[0]["cli printed"]
    assert "split over 2 ranks, 1 of 2 kv heads each" in printed
    assert f"prompt 1: {PROMPTS[0]}\n  -> {want[0]}\n" in printed
    assert seen[1]["cli printed"] == ""


@pytest.mark.parametrize("heads, kv_heads, ranks, per_rank", [
    (32, 8, 1, 8), (32, 8, 2, 4), (32, 8, 8, 1), (4, 2, 2, 1)])
def test_each_rank_holds_its_share_of_the_kv_heads(heads, kv_heads, ranks, per_rank):
    assert kv_heads_per_rank(heads, kv_heads, ranks) == per_rank


@pytest.mark.parametrize("heads, kv_heads, ranks, fits", [
    (32, 8, 3, "serve it on 1, 2, 4 or 8 ranks"),
    (4, 2, 4, "serve it on 1 or 2 ranks"),
    (6, 4, 4, "serve it on 1 or 2 ranks"),          # query heads: 6 over 4 ranks
])
def test_heads_the_ranks_cannot_share_are_refused_naming_heads_and_ranks(heads, kv_heads,
                                                                         ranks, fits):
    with pytest.raises(kv.ConfigError, match=rf"llama: {kv_heads} kv heads and {heads} "
                                             rf"query heads cannot be split over {ranks} "
                                             rf"ranks .*{fits} \(torchrun"):
        kv_heads_per_rank(heads, kv_heads, ranks, model_type="llama")


def test_check_ranks_is_a_bool():
    with pytest.raises(kv.ConfigError, match=r"check_ranks='yes': pass True or False"):
        from kvnumba.hf import Engine
        Engine(tiny("llama"), max_seqs=1, capacity=8, check_ranks="yes")


def test_follow_is_refused_outside_a_split_models_other_ranks():
    from kvnumba.hf import Engine
    model = tiny("llama")
    engine = Engine(model, max_seqs=1, capacity=16, verify=False, dtype="float32")
    with pytest.raises(kv.StepProtocolError, match=r"follow\(\): only a rank other than 0 "
                                                   r"of a split model follows rank 0; call "
                                                   r"step\(\)"):
        engine.follow()
    engine.close()                                  # one process: nothing to tell
    assert engine.generate([PROMPTS[0]], max_new_tokens=2) == [generated(model, PROMPTS[0], 2)]


class Mesh:
    """A device mesh's shape as `sharding` reads it: dimension names and sizes."""

    def __init__(self, **sizes):
        self.mesh_dim_names, self.shape = tuple(sizes), tuple(sizes.values())
        self.ndim = len(sizes)

    def size(self, dim):
        return self.shape[dim]


@pytest.mark.parametrize("mesh, match", [
    (None, r"llama: split over 2 ranks \(tp_size\), but without the device mesh .*"
           r"tp_plan='auto'"),
    (Mesh(pp=2, fsdp=1, tp=2), r"llama: the model is split over ranks by pp 2 besides "
                               r"tensor parallelism \(tp 2\); kvnumba serves tensor "
                               r"parallelism alone"),
])
def test_a_model_split_otherwise_than_by_its_heads_is_refused(mesh, match):
    from types import SimpleNamespace

    from kvnumba.hf.sharding import sharding
    model = SimpleNamespace(tp_size=2, _device_mesh=mesh,
                            config=SimpleNamespace(model_type="llama"))
    with pytest.raises(kv.ConfigError, match=match):
        sharding(model)
