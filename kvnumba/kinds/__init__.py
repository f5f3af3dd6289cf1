"""Layer kinds (contract §1): each kind of layer is one type answering the same questions
(`base.LayerKind`): what it stores per position and per sequence, the storage it
allocates, its mask, the pages it takes at claim and per step, its floor, what a clone
copies, what a prefix registration keeps and a hit restores. One module per kind:
`flat` (`Flat`), `latent` (`Latent`, a flat layer of one stored row), `ring` (`Ring`,
sliding windows, and `Chunked`) and `shared` (`Shared`, reading another layer's K/V), and `state` (`State`, a mixer's
per-sequence state: no pages).
The configuration, the page accounting, the prefix index, the storage and the routing
loop over kinds instead of branching on a layer spec's fields."""
from .base import LayerKind, LayerShape
from .flat import Flat
from .latent import Latent
from .ring import Chunked, Ring
from .shared import Shared
from .state import State

__all__ = ["LayerKind", "LayerShape", "Flat", "Latent", "Ring", "Chunked", "Shared", "State"]
