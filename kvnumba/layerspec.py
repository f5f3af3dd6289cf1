"""A cache's layers (contract §3, §15, §16): `LayerSpec`, one layer's kind (flat, a
sliding-window ring, chunked, shared with another layer, latent, or a mixer's state: a
`kinds` type, its `kind`) and shape, built by `flat()`, `ring()`, `chunked()`,
`shared()`, `latent()` and `state()`;
and the head-dim bounds the kernels are built for.

Every refusal is a `ConfigError` naming the field and the rule it broke.
"""
from __future__ import annotations

from dataclasses import dataclass

from .args import describe, is_int
from .errors import ConfigError
from .kinds import Chunked, Flat, Latent, LayerShape, Ring, Shared, State  # noqa: F401 (LayerShape re-exported)
from .kinds.ring import RingPages

#: the largest head_dim (K's or V's) a layer may have: the generic attention kernel and
#: the tensor cores' wide tile serve up to it, the fast paths up to their own bounds
#: (`kernels.decode.supports`, `kernels.prefill.supports`, `supports_wide`)
MAX_HEAD_DIM = 512
#: the widest row a latent layer may store (`latent`: rank + rope_dim; DeepSeek-V3's
#: 512 + 64), served by the wide tile and the generic kernel's widest tiles
MAX_LATENT_DIM = 576
#: the largest head_dim the standard decode and tensor-core tiles are built for (a wider
#: layer takes the wide tile, or the generic kernel)
FAST_MAX_HEAD_DIM = 256
#: the widest key or value head a state layer's recurrent state may have (the
#: recurrence kernels keep a state column of k_dim per thread)
MAX_STATE_DIM = 256
#: the widest convolution a state layer keeps the window of
MAX_CONV_WIDTH = 64
#: positions, token indices, storage slots and page-table entries travel to the kernels
#: as int32
INT32_MAX = 2**31 - 1

@dataclass(frozen=True)
class LayerSpec:
    """One layer's kind and shape: flat (neither `window` nor `chunk` set), a
    sliding-window ring of `window` positions, a chunked ring whose queries see their own
    chunk of `chunk` positions, or a layer that reads layer `producer`'s K/V and stores
    nothing (contract §15); `latent`: a layer of one stored row per position whose first
    `v_head_dim` values are its V (contract §16, `latent()`); `conv` / `recurrent`: a
    state layer (contract §17, `state()`), which sets nothing else.

    `n_kv_heads`, `head_dim`, `v_head_dim`: the layer's own shape (None: the config's
    `n_kv_heads` and `head_dim`; `v_head_dim` defaults to the layer's `head_dim`). A
    shared layer takes its producer's kind and shape and sets none of them.

    Build it with `flat()`, `ring(window=W)`, `chunked(size=C)`, `shared(producer)` or
    `latent(rank, rope_dim)`; a `LayerSpec` built directly is checked the same way
    (`window`, `chunk`, `n_kv_heads`, `v_head_dim` None or an int >= 1, `head_dim` and
    `v_head_dim` at most `MAX_HEAD_DIM`, `producer` None or an int >= 0; not `window` and
    `chunk` both, and nothing else with `producer`; a latent layer one kv head, a row
    of at most `MAX_LATENT_DIM` and a V narrower than it: else `ConfigError`).
    """

    window: int | None = None
    chunk: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    producer: int | None = None
    latent: bool = False
    conv: tuple | None = None
    recurrent: tuple | None = None

    def __post_init__(self):
        if not isinstance(self.latent, bool):
            raise ConfigError(f"LayerSpec(latent={describe(self.latent)}): latent must be "
                              f"True or False")
        widest = MAX_LATENT_DIM if self.latent else MAX_HEAD_DIM
        for name, lo, hi in (("window", 1, INT32_MAX), ("chunk", 1, INT32_MAX),
                             ("n_kv_heads", 1, INT32_MAX), ("head_dim", 1, widest),
                             ("v_head_dim", 1, MAX_HEAD_DIM), ("producer", 0, INT32_MAX)):
            value = getattr(self, name)
            if value is None:
                continue
            if not is_int(value) or not lo <= value <= hi:
                raise ConfigError(f"LayerSpec({name}={describe(value)}): {name} must be None "
                                  f"or an integer in [{lo}, {hi}]")
            object.__setattr__(self, name, int(value))
        if self.window is not None and self.chunk is not None:
            raise ConfigError(f"LayerSpec(window={self.window}, chunk={self.chunk}): a layer "
                              f"is a sliding window or chunked, not both")
        if self.producer is not None:
            given = [f"{name}={getattr(self, name)}" for name in
                     ("window", "chunk", "n_kv_heads", "head_dim", "v_head_dim")
                     if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"LayerSpec(producer={self.producer}, {', '.join(given)}): "
                                  f"a shared layer takes its producer's kind and shape; set "
                                  f"them on layer {self.producer}")
        if self.latent and not (self.n_kv_heads == 1 and self.head_dim is not None
                                and self.v_head_dim is not None
                                and self.v_head_dim < self.head_dim
                                and self.producer is None):
            raise ConfigError(f"LayerSpec(latent=True, n_kv_heads={self.n_kv_heads}, "
                              f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}): a "
                              f"latent layer stores one kv head of head_dim values, its V "
                              f"the first v_head_dim < head_dim of them (latent(rank, "
                              f"rope_dim))")

        if self.conv is not None or self.recurrent is not None:
            self._check_state()
        object.__setattr__(self, "_kind", _kind_of(self))

    def _check_state(self) -> None:
        """A state layer's parts: `conv` `(channels, width)`, `recurrent` `(heads, k_dim,
        v_dim)` (ints >= 1, head dims at most `MAX_STATE_DIM`), and no other field."""
        for name, fields, highs in (("conv", ("channels", "width"), (INT32_MAX, MAX_CONV_WIDTH)),
                                    ("recurrent", ("heads", "k_dim", "v_dim"),
                                     (INT32_MAX, MAX_STATE_DIM, MAX_STATE_DIM))):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (tuple, list)) or len(value) != len(fields) or not all(
                    is_int(x) and 1 <= x <= hi for x, hi in zip(value, highs)):
                rule = ", ".join(f"{f} in [1, {hi}]" for f, hi in zip(fields, highs))
                raise ConfigError(f"state({name}={describe(value)}): {name} must be None or "
                                  f"({', '.join(fields)}) with {rule}")
            object.__setattr__(self, name, tuple(int(x) for x in value))
        given = [f"{name}={getattr(self, name)}" for name in
                 ("window", "chunk", "n_kv_heads", "head_dim", "v_head_dim", "producer")
                 if getattr(self, name) is not None] + (["latent=True"] if self.latent else [])
        if given:
            raise ConfigError(f"LayerSpec(conv={self.conv}, recurrent={self.recurrent}, "
                              f"{', '.join(given)}): a state layer keeps a mixer's state and "
                              f"nothing else; build it with state(conv=..., recurrent=...)")

    @property
    def kind(self):
        """The layer's kind (`kvnumba.kinds`): `Flat`, `Ring`, `Chunked`, `Shared` or
        `Latent`, which answers everything the cache asks of the layer."""
        return self._kind

    @property
    def stores(self) -> bool:
        """Whether the layer holds K/V of its own (every kind but `shared`)."""
        return self._kind.stores

    @property
    def keeps_state(self) -> bool:
        """Whether the layer keeps a mixer's state per sequence (`state()`)."""
        return self._kind.keeps_state

    @property
    def is_ring(self) -> bool:
        """Whether the layer is stored as a ring (sliding-window or chunked)."""
        return isinstance(self._kind, RingPages)

    def describe(self) -> str:
        """How refusals name it: "flat", "window 4096", "chunks of 8192", "shared with
        layer 3"."""
        return self._kind.describe()


def _kind_of(spec: LayerSpec):
    """The `kinds` type of a checked spec's fields."""
    if spec.conv is not None or spec.recurrent is not None:
        return State(spec.conv, spec.recurrent)
    if spec.producer is not None:
        return Shared(spec.producer)
    if spec.latent:
        return Latent(spec.v_head_dim, spec.head_dim - spec.v_head_dim)
    if spec.window is not None:
        return Ring(spec.window)
    return Chunked(spec.chunk) if spec.chunk is not None else Flat()


def flat(*, n_kv_heads: int | None = None, head_dim: int | None = None,
         v_head_dim: int | None = None) -> LayerSpec:
    """A flat layer: position `p` lives in row `p`; every past position stays visible.
    `n_kv_heads`, `head_dim`, `v_head_dim`: the layer's shape (None: the config's;
    `v_head_dim`: the layer's `head_dim`)."""
    return LayerSpec(None, None, n_kv_heads, head_dim, v_head_dim)


def ring(window: int, *, n_kv_heads: int | None = None, head_dim: int | None = None,
         v_head_dim: int | None = None) -> LayerSpec:
    """A sliding-window layer: a query at `p` sees keys `max(0, p - window + 1) <= j <= p`.

    This is Hugging Face's `sliding_window=window` and FlashAttention's
    `window_size=(window - 1, 0)`. The shape arguments are `flat()`'s.
    """
    if window is None:
        raise ConfigError("ring(window=None): window must be an integer >= 1 (use flat() for "
                          "a layer without a window)")
    return LayerSpec(window, None, n_kv_heads, head_dim, v_head_dim)


def chunked(size: int, *, n_kv_heads: int | None = None, head_dim: int | None = None,
            v_head_dim: int | None = None) -> LayerSpec:
    """A chunked local-attention layer: a query at `p` sees keys `size * (p // size) <= j
    <= p`, its own chunk up to itself (Hugging Face's `chunked_attention` layers with
    `attention_chunk_size=size`, as in Llama 4). Stored as a ring of `min(capacity, size +
    max_write - 1)` rows. The shape arguments are `flat()`'s."""
    if size is None:
        raise ConfigError("chunked(size=None): size must be an integer >= 1 (use flat() for "
                          "a layer without chunks)")
    return LayerSpec(None, size, n_kv_heads, head_dim, v_head_dim)


def shared(producer: int) -> LayerSpec:
    """A layer that attends over layer `producer`'s K/V and stores nothing (Gemma 4's
    `num_kv_shared_layers`): its kind, window and shape are the producer's; `write` to it
    is refused and `attend` reads the producer's K/V as the step has written them."""
    if producer is None:
        raise ConfigError("shared(producer=None): producer must be the index of a layer "
                          "that stores K/V")
    return LayerSpec(producer=producer)


def latent(rank: int, rope_dim: int) -> LayerSpec:
    """A multi-head latent attention layer (DeepSeek-V2/V3's; contract §16): one kv head,
    one stored row of `rank + rope_dim` values per position, the compressed latent then
    its rotary part; V is the row's first `rank` values. Queries come absorbed (`[T,
    n_q_heads, rank + rope_dim]`), the output is `[T, n_q_heads, rank]`, and `write`
    takes the rows as `k` with `v=None`. Flat: every past position stays visible."""
    for name, value in (("rank", rank), ("rope_dim", rope_dim)):
        if not is_int(value) or value < (1 if name == "rank" else 0):
            raise ConfigError(f"latent({name}={describe(value)}): {name} must be an integer "
                              f">= {1 if name == 'rank' else 0}")
    if rank + rope_dim > MAX_LATENT_DIM or rope_dim < 1:
        raise ConfigError(f"latent(rank={rank}, rope_dim={rope_dim}): a latent row holds "
                          f"2 to {MAX_LATENT_DIM} values (rank + rope_dim), its rope part "
                          f"at least one")
    return LayerSpec(n_kv_heads=1, head_dim=int(rank) + int(rope_dim), v_head_dim=int(rank),
                     latent=True)



def state(*, conv=None, recurrent=None) -> LayerSpec:
    """A state layer (contract §17): a hybrid model's mixer, keeping per sequence the window
    of a depthwise causal convolution over `channels` inputs of `width` taps (`conv=(channels,
    width)`: its inputs, kept in the cache's storage dtype) and/or a recurrent state of
    `heads` heads, each a float32 `[k_dim, v_dim]` matrix (`recurrent=(heads, k_dim,
    v_dim)`; Mamba2's `ssd` declares `(heads, head_dim, d_state)`). At least one part.
    Its data path is `conv` and `delta_rule` or `ssd`, not `write` / `attend`; it takes
    no pages, and rewinds and clones restore its state exactly down to the floor of a
    ring of window 1 (`kinds.state`)."""
    if conv is None and recurrent is None:
        raise ConfigError("state(conv=None, recurrent=None): a state layer keeps a conv "
                          "window (conv=(channels, width)), a recurrent state "
                          "(recurrent=(heads, k_dim, v_dim)), or both")
    return LayerSpec(conv=conv, recurrent=recurrent)
