"""Tensor-parallel serving (contract §13): each rank's share of the kv heads, and the
refusals of heads the ranks cannot share and of models split otherwise than by their
heads."""
import pytest

import kvnumba as kv
from kvnumba.hf.sharding import kv_heads_per_rank


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
