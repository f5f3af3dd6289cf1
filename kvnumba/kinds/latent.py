"""The latent kind (contract §16): multi-head latent attention's layer, one kv head and
one stored row of `rank + rope_dim` values per position, V the row's first `rank`
values. Paged as a flat layer (`Flat`): only its storage, its bytes and its scales
differ."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .base import LayerShape
from .flat import Flat


@dataclass(frozen=True)
class Latent(Flat):
    """A latent layer of `rank` latent and `rope_dim` rotary values a row
    (`kv.latent(rank, rope_dim)`)."""

    rank: int
    rope_dim: int
    name = "latent"
    v_in_k = True

    def describe(self) -> str:
        return f"latent of rank {self.rank} + {self.rope_dim} rope values"

    def validate(self, layer: int, config) -> None:
        """Its V is read from its stored rows, so at its K's scale."""
        if config.v_scale[layer] != config.k_scale[layer]:
            raise ConfigError(f"v_scale[{layer}]={config.v_scale[layer]}: layer {layer} is "
                              f"latent, its V the first values of its stored rows, read at "
                              f"their k_scale {config.k_scale[layer]}; give it the same "
                              f"v_scale")

    def position_bytes(self, shape: LayerShape, itemsize: int) -> int:
        return shape.n_kv_heads * shape.head_dim * itemsize

    def planes(self, shape: LayerShape) -> tuple:
        return (("k", shape.head_dim),)
