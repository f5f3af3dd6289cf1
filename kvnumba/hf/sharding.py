"""A model's tensor-parallel state (`Sharding`): how many ranks split its attention heads,
this process's rank among them and their `torch.distributed` process group, read from
what `transformers`' `tp_plan` loading leaves on the model; and the kv heads each rank's
cache holds, or a refusal naming heads and ranks.

`from_pretrained(..., tp_plan="auto")` under torchrun opens the process group, sets
`model.tp_size` and keeps the device mesh the model is split over; each rank's
projections then produce that rank's share of the query and kv heads, while
`config.num_key_value_heads` still gives the model's total. A rank holds whole heads
only: a head count the ranks cannot share is refused here, before any cache is made
(`transformers` would split a kv head across ranks and fail in the forward).
"""
from __future__ import annotations

import os
import sys
from typing import NamedTuple

from ..errors import ConfigError


class Sharding(NamedTuple):
    """How a model is split: over `ranks` ranks (1: not split), this process being rank
    `rank` of them, all in process group `group` (None when not split)."""

    ranks: int
    rank: int
    group: object

    @property
    def members(self) -> tuple:
        """The global ranks of the group, in group order (`()` when not split)."""
        if self.group is None:
            return ()
        import torch.distributed as dist
        return tuple(dist.get_process_group_ranks(self.group))


UNSPLIT = Sharding(1, 0, None)


def launched_ranks() -> int:
    """The processes torchrun started for this job (`WORLD_SIZE`; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank in the torchrun job (`RANK`; 0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def split_loading() -> dict:
    """The `from_pretrained` options that split a model over the torchrun job's ranks by
    its own tensor-parallel plan (`transformers` opens the process group: gloo on CPUs,
    NCCL on GPUs; it needs `accelerate`)."""
    import transformers
    config = getattr(transformers, "DistributedConfig", None)
    return {"tp_plan": "auto"} if config is None else {"distributed_config":
                                                        config(tp_plan="auto")}


def close_ranks() -> None:
    """Destroy `torch.distributed`'s process groups where this process opened them (the
    end of a `python -m kvnumba` command under torchrun; nothing where torch was never
    imported or no group is open). A gloo group left to the end of the process frees its
    last collective's buffers from its own thread, which needs the interpreter: while
    Python finalizes, that thread is killed and the process aborts (SIGABRT, or SIGSEGV)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def sharding(model) -> Sharding:
    """The tensor-parallel state `transformers` left on `model` (`UNSPLIT` for a model
    loaded without `tp_plan`). A model also split another way (pipeline stages, FSDP
    shards) is a `ConfigError`: kvnumba serves tensor parallelism alone."""
    ranks = getattr(model, "tp_size", None) or 1
    if ranks == 1:
        return UNSPLIT
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        raise ConfigError(f"{model.config.model_type}: split over {ranks} ranks (tp_size), "
                          f"but without the device mesh transformers keeps for a model it "
                          f"loads split (model._device_mesh); load it with "
                          f"from_pretrained(..., tp_plan='auto') under torchrun")
    names = mesh.mesh_dim_names or ()
    if mesh.ndim > 1:
        others = {name: mesh.size(i) for i, name in enumerate(names)
                  if name != "tp" and mesh.size(i) > 1}
        if others:
            split = ", ".join(f"{name} {size}" for name, size in others.items())
            raise ConfigError(f"{model.config.model_type}: the model is split over ranks by "
                              f"{split} besides tensor parallelism (tp {ranks}); kvnumba "
                              f"serves tensor parallelism alone: load it with tp_plan='auto' "
                              f"and no other split")
        mesh = mesh["tp"]
    return Sharding(int(ranks), int(mesh.get_local_rank()), mesh.get_group())


def kv_heads_per_rank(num_attention_heads: int, num_key_value_heads: int, ranks: int, *,
                      model_type: str = "the model") -> int:
    """The kv heads each of `ranks` ranks holds when they split the model's
    `num_attention_heads` query and `num_key_value_heads` kv heads: whole heads, the same
    count on every rank. `ConfigError` naming the heads, the ranks and the rank counts
    that would serve the model when either head count is not a multiple of `ranks`."""
    if num_attention_heads % ranks or num_key_value_heads % ranks:
        fits = [n for n in range(1, num_key_value_heads + 1)
                if not num_key_value_heads % n and not num_attention_heads % n]
        raise ConfigError(f"{model_type}: {_counted([num_key_value_heads], 'kv head')} and "
                          f"{_counted([num_attention_heads], 'query head')} cannot be split "
                          f"over {ranks} ranks (each rank holds whole heads, as many as every "
                          f"other); "
                          f"serve it on {_counted(fits, 'rank')} (torchrun --nproc-per-node)")
    return num_key_value_heads // ranks


def _counted(counts: list, noun: str) -> str:
    """`[1]` as "1 rank", `[2]` as "2 ranks", `[1, 2, 4]` as "1, 2 or 4 ranks"."""
    if len(counts) == 1:
        return f"{counts[0]} {noun}{'s' if counts[0] != 1 else ''}"
    return f"{', '.join(map(str, counts[:-1]))} or {counts[-1]} {noun}s"


def check_draft(model_sharding: Sharding, draft_sharding: Sharding) -> None:
    """`ConfigError` unless the draft model is split as the model is: over the same ranks
    of the same group (each rank's step runs both on that rank's heads)."""
    if (draft_sharding.ranks, draft_sharding.members) == \
            (model_sharding.ranks, model_sharding.members):
        return

    def said(split: Sharding) -> str:
        if split.ranks == 1:
            return "not split (1 rank)"
        return f"split over {split.ranks} ranks (global ranks {list(split.members)})"
    raise ConfigError(f"draft_model: {said(draft_sharding)}, the model {said(model_sharding)}; "
                      f"load both with the same tensor-parallel plan in the same job "
                      f"(from_pretrained(..., tp_plan='auto') under torchrun), or neither")
