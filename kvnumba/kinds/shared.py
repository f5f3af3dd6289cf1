"""The shared kind (contract §15): a layer that attends over another layer's K/V (Gemma
4's `num_kv_shared_layers`) and stores nothing. It holds no pages and no bytes; its mask,
rows and floor are its producer's (`CacheConfig.reads`), and `write` to it is refused."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .base import LayerShape


@dataclass(frozen=True)
class Shared:
    """A layer reading layer `producer`'s K/V (`kv.shared(producer)`)."""

    producer: int
    name = "shared"
    stores = False
    keeps_state = False

    def source(self, layer: int) -> int:
        return self.producer

    def describe(self) -> str:
        return f"shared with layer {self.producer}"

    def validate(self, layer: int, config) -> None:
        """The producer must be another layer that stores K/V."""
        p, layers = self.producer, config.layers
        if p >= len(layers) or p == layer or not layers[p].kind.stores:
            why = (f"there are {len(layers)} layers" if p >= len(layers) else
                   "a layer cannot share its own K/V" if p == layer else
                   f"layer {p} is itself {layers[p].describe()}")
            raise ConfigError(f"layers[{layer}]=shared({p}): the producer must be another "
                              f"layer that stores K/V ({why})")

    def position_bytes(self, shape: LayerShape, itemsize: int) -> int:
        return 0

    def planes(self, shape: LayerShape) -> tuple:
        return ()
