"""Cache configuration (contract §3): `CacheConfig` over the layers of `kvnumba.layerspec`
(`flat()`, `ring()`, `chunked()`, `shared()`, `latent()`, `state()`), each answering
through its
kind (`kvnumba.kinds`), and the page groups its layers' pages form (`PageGroup`).

Validation happens at construction; every refusal is a `ConfigError` naming the
field and the rule it broke.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np

from .args import as_count, describe, is_int
from .errors import ConfigError
from .arith.pages import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, MIN_PAGE_SIZE, pages_for
from .layerspec import (FAST_MAX_HEAD_DIM, INT32_MAX, MAX_HEAD_DIM,  # noqa: F401 (re-exported)
                        MAX_LATENT_DIM, LayerShape, LayerSpec, chunked, flat, latent, ring,
                        shared, state)

#: storage dtypes, by name: the dtype of the device arrays. Numba has no bfloat16 or
#: 8-bit float types, so those arrays hold bit patterns, each format in its own integer
#: type (the element type tells a kernel the format): bfloat16 as uint16, float8_e4m3
#: as uint8, float8_e5m2 as int8
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
          "float8_e4m3": np.uint8, "float8_e5m2": np.int8}
#: the 8-bit float storage dtypes: K and V stored as `stored = convert(x / scale)`, read
#: as `scale * stored` (a float32 scale per layer, `k_scale` / `v_scale`); each named
#: "float8_" and its format as PTX names it (the kernels' format names derive from these)
FP8_DTYPES = ("float8_e4m3", "float8_e5m2")
#: the largest finite value of each 8-bit float format (a write saturates to it)
FP8_LARGEST = {"float8_e4m3": 448.0, "float8_e5m2": 57344.0}
#: the host (NumPy) dtype of each storage dtype held as bit patterns, from ml_dtypes
ML_DTYPES = {"bfloat16": "bfloat16", "float8_e4m3": "float8_e4m3fn",
             "float8_e5m2": "float8_e5m2"}
#: the dtypes a state layer's recurrent state may be kept in (bfloat16 as uint16 bits,
#: rounded to nearest even each time a kernel stores it)
STATE_DTYPES = ("float32", "bfloat16")
#: the default pool's first pages of the group paged by position hold this many positions of one sequence
INITIAL_POSITIONS = 256


class PageGroup(NamedTuple):
    """The layers that share page ids (contract §4): every layer paged by position (flat
    and latent layers, `rows` 0), or the ring layers of one ring size `rows` (R); layers
    that store nothing are in none. `kind`: the kind of its first layer, which decides
    what its pages do (`kinds.base.LayerKind`: every member pages alike); `layers`: their
    indices; `table_pages`: the pages one sequence's page table can list
    (`CacheConfig.table_pages`); `initial_pages` and `max_pages`: the pool's first and
    most pages (`CacheConfig.group_pages`); `position_bytes`: bytes of one position over
    its layers (a page id of the group holds `page_size` times that)."""

    kind: object
    rows: int
    layers: tuple
    table_pages: int
    initial_pages: int
    max_pages: int
    position_bytes: int

    @property
    def name(self) -> str:
        """How refusals and reports call it: "flat layers" or "ring layers of R rows"."""
        return "flat layers" if self.rows == 0 else f"ring layers of {self.rows} rows"


def _require_int(name: str, value, lo: int, hi: int | None = None, rule: str = "") -> int:
    if not is_int(value):
        raise ConfigError(f"{name}={describe(value)}: must be an integer")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo} <= {name}" + (f" <= {hi}" if hi is not None else "")
        raise ConfigError(f"{name}={value}: requires {rule or bound}")
    return int(value)


def _layer_scales(name: str, value, n: int, dtype: str) -> tuple:
    """`value` (one scale, or one per layer of `n`) as a tuple of float32-exact floats, one
    per layer: positive, finite, and with a finite float32 reciprocal (the write
    multiplies by it); anything but 1.0 only for fp8 storage (`dtype`)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]                # a 0-d array: its one number
    scales = tuple(value) if isinstance(value, (list, tuple, np.ndarray)) else (value,) * n
    if len(scales) != n:
        raise ConfigError(f"{name}: {len(scales)} scales for {n} layers: give one "
                          f"number, or one per layer")
    out = []
    for i, scale in enumerate(scales):
        where = f"{name}[{i}]={describe(scale)}" if isinstance(
            value, (list, tuple, np.ndarray)) else f"{name}={describe(scale)}"
        if isinstance(scale, (bool, np.bool_)) or not isinstance(
                scale, (int, float, np.integer, np.floating)):
            raise ConfigError(f"{where}: must be a positive finite number")
        if is_int(scale) and abs(int(scale)) > float(np.finfo(np.float32).max):
            scale = math.inf if scale > 0 else -math.inf    # past float's range too
        with np.errstate(over="ignore", divide="ignore"):
            f32 = np.float32(scale)
            inverse = np.float32(1) / f32 if f32 > 0 else np.float32(0)
        if not (np.isfinite(f32) and f32 > 0 and np.isfinite(inverse) and inverse > 0):
            raise ConfigError(f"{where}: must be positive and finite as a float32, with "
                              f"a finite reciprocal (the write divides by it)")
        if f32 != 1 and dtype not in FP8_DTYPES:
            raise ConfigError(f"{where}: scales apply to fp8 storage ({', '.join(FP8_DTYPES)}) "
                              f"only; dtype={dtype!r} takes 1.0")
        out.append(float(f32))
    return tuple(out)


def _check_pages(config: "CacheConfig") -> None:
    """`page_size`, `max_pages` and `initial_pages` of a config being built, and its page
    tables' size."""
    size = config._set_int("page_size", config.page_size, MIN_PAGE_SIZE, MAX_PAGE_SIZE)
    if size & (size - 1):
        raise ConfigError(f"page_size={size}: requires a power of two from "
                          f"{MIN_PAGE_SIZE} to {MAX_PAGE_SIZE}")
    slot_bound = INT32_MAX // size      # a pool's slots are int32 in the kernels
    if config.max_pages is not None:
        config._set_int("max_pages", config.max_pages, 1, slot_bound,
                      rule=f"1 <= max_pages <= {slot_bound} (max_pages x page_size "
                           f"{size} slots must stay int32)")
    if config.initial_pages is not None:
        hi = config.max_pages if config.max_pages is not None else slot_bound
        config._set_int("initial_pages", config.initial_pages, 1, hi,
                      rule=f"1 <= initial_pages <= max_pages ({hi})")
    entries = (config.max_seqs + 1) * sum(group.table_pages for group in config.page_groups)
    if entries > INT32_MAX:
        raise ConfigError(f"max_seqs={config.max_seqs}, capacity={config.capacity}, "
                          f"page_size={size}: the page tables would hold {entries} "
                          f"entries, more than {INT32_MAX} (their indices are int32): "
                          f"use larger pages or fewer sequences per cache")


def _check_states(config: "CacheConfig") -> None:
    """State layers' dtype, and at least one layer that attends beside them."""
    if config.state_dtype not in STATE_DTYPES:
        raise ConfigError(f"state_dtype={describe(config.state_dtype)}: state layers keep "
                          f"their recurrent state in {', '.join(STATE_DTYPES)}")
    if config.state_interval is not None:
        interval = config._set_int("state_interval", config.state_interval, 1, INT32_MAX)
        if interval % config.page_size:
            raise ConfigError(f"state_interval={interval}: must be a multiple of "
                              f"page_size ({config.page_size}): snapshots are taken at "
                              f"page ends")


def _state_bytes(config: "CacheConfig", snapshot: bool) -> int:
    """Bytes over the state layers of one sequence (`bytes_per_sequence`) or of one prefix
    `snapshot` (`snapshot_bytes`): `kinds.state`'s, at the storage and state dtypes'."""
    itemsize, state = config.storage_dtype.itemsize, config.state_storage_dtype.itemsize
    kinds = [config.kinds[i] for i in config.state_layers]
    if snapshot:
        return sum(kind.snapshot_bytes(itemsize, state) for kind in kinds)
    return sum(kind.sequence_bytes(itemsize, state, config.max_write, config.capacity)
               for kind in kinds)


def _snapshot_interval(config: "CacheConfig") -> int:
    """`CacheConfig.snapshot_interval` (its doc)."""
    if config.state_interval is not None:
        return config.state_interval
    per_page = config.page_size * config.bytes_per_token
    if not per_page:              # no K/V to weigh a snapshot against: registration ends
        return config.table_pages(0) * config.page_size
    return config.page_size * max(1, -(-config.snapshot_bytes // per_page))


def _fixed_pages(config: "CacheConfig", nbytes: int) -> int:
    """The pages a fixed pool of `nbytes` bytes holds (`CacheConfig.fixed_pool`), refused
    (`ConfigError`) for fewer than 2 or a cache with no page pool."""
    if not config.page_groups:
        raise ConfigError(f"fixed_pool({nbytes}): every layer is a state layer, so the "
                          f"cache has no page pool to fix; its bytes are "
                          f"bytes_per_sequence ({config.bytes_per_sequence}) for each "
                          f"of max_seqs + 1 = {config.max_seqs + 1} slots")
    per_page = config.page_size * config.bytes_per_token
    n = as_count(nbytes, "fixed_pool nbytes", 0) // per_page
    if n < 2:
        raise ConfigError(f"fixed_pool({nbytes}): a pool needs at least 2 pages of "
                          f"{per_page} bytes (page_size {config.page_size} x "
                          f"bytes_per_token {config.bytes_per_token}), so at least "
                          f"{2 * per_page} bytes")
    return min(n, INT32_MAX // config.page_size)


def _host_dtype(dtype: str, storage: np.dtype) -> np.dtype:
    """`CacheConfig.np_dtype` of storage dtype `dtype` (held as `storage`)."""
    if dtype not in ML_DTYPES:
        return storage
    if importlib.util.find_spec("ml_dtypes") is None:
        raise ConfigError(f"dtype={dtype!r}: NumPy host arrays of {dtype} need "
                          f"the ml_dtypes package: pip install -e '.[bf16]' in a "
                          f"kvnumba checkout (or pip install ml_dtypes)")
    import ml_dtypes
    return np.dtype(getattr(ml_dtypes, ML_DTYPES[dtype]))


@dataclass(frozen=True)
class CacheConfig:
    """Shape and limits of a cache.

    layers:       one `LayerSpec` per layer (`flat()`, `ring(window=W)`, `chunked(size=C)`,
                  each with an optional shape of its own, or `shared(producer)`).
    n_kv_heads:   K/V heads of a layer that does not set its own (`flat(n_kv_heads=...)`).
    head_dim:     elements per head of a layer that does not set its own, 1..512
                  (`MAX_HEAD_DIM`; the fast paths take up to 256, `FAST_MAX_HEAD_DIM`).
    capacity:     most positions one sequence may hold (a hard bound).
    max_seqs:     sequence slots handed out (ids `0 .. max_seqs - 1`).
    max_write:    most tokens one sequence writes in one step (`M`).
    max_step:     most tokens, padding included, in one step.
    dtype:        storage dtype, "float32", "float16", "bfloat16", or 8-bit floats
                  "float8_e4m3" / "float8_e5m2" (half the bytes of 16-bit storage; written
                  as `x / scale` with saturation, read as `scale * stored`; compute
                  capability 8.9 or later). NumPy host arrays of bfloat16 and fp8 need the
                  ml_dtypes package, `kvnumba[bf16]`; PyTorch tensors and device arrays
                  do not.
    k_scale, v_scale: fp8 storage only: the float32 scale of each layer's K and V (one
                  number for every layer, or one per layer), positive and finite, fixed
                  for the cache's life (default 1.0; `fp8_scales` computes them from
                  sample K/V); a latent layer's two are one (its V is part of its rows).
                  Any other dtype takes 1.0 only.
    page_size:    positions per page, a power of two from 8 to 256 (default 16).
    initial_pages: pages each page group's pool starts with (None: one sequence's worth,
                  `group_pages`); the pool grows by doubling up to `max_pages`.
    state_dtype:  state layers' recurrent states (`state()`): "float32" (default) or
                  "bfloat16" (half their bytes, rounded when stored: contract §17).
    state_interval: positions between the prefix index's state snapshots (contract §17;
                  a multiple of `page_size`); None: the fewest whole pages whose K/V bytes
                  reach one snapshot's, so snapshots cost no more than the pages they
                  cover (`snapshot_interval`); in a cache of state layers alone (no K/V
                  to weigh them against) a snapshot only where a registration ends.
    max_pages:    the most pages each page group's pool may hold (None: enough for every
                  sequence at capacity, so the pool never binds); `initial_pages ==
                  max_pages` is a fixed pool that never moves (`fixed_pool` sizes one
                  from a byte budget). A pool's pages include one scratch page.
    """

    layers: list = field(default_factory=lambda: [flat()])
    n_kv_heads: int = 1
    head_dim: int = 64
    capacity: int = 4096
    max_seqs: int = 1
    max_write: int = 512
    max_step: int = 1024
    dtype: str = "float16"
    k_scale: float | tuple = 1.0
    v_scale: float | tuple = 1.0
    page_size: int = DEFAULT_PAGE_SIZE
    initial_pages: int | None = None
    max_pages: int | None = None
    state_dtype: str = "float32"
    state_interval: int | None = None

    def __post_init__(self):
        if not isinstance(self.layers, (list, tuple)):
            raise ConfigError(f"layers={describe(self.layers)}: must be a list of LayerSpec, "
                              f"e.g. [flat(), ring(window=4096)]")
        layers = tuple(self.layers)
        if not layers:
            raise ConfigError("layers=[]: requires at least one layer")
        for i, spec in enumerate(layers):
            if not isinstance(spec, LayerSpec):
                raise ConfigError(f"layers[{i}]={describe(spec)}: must be flat(), "
                                  f"ring(window=...), chunked(size=...) or shared(producer)")
        object.__setattr__(self, "layers", layers)
        self._set_int("n_kv_heads", self.n_kv_heads, 1)
        self._set_int("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        self._set_int("capacity", self.capacity, 1, INT32_MAX,
                      rule=f"1 <= capacity <= {INT32_MAX} (positions are int32)")
        self._set_int("max_seqs", self.max_seqs, 1, INT32_MAX - 1)
        self._set_int("max_write", self.max_write, 1, self.capacity,
                      rule=f"1 <= max_write <= capacity ({self.capacity})")
        self._set_int("max_step", self.max_step, self.max_write, INT32_MAX,
                      rule=f"max_step >= max_write ({self.max_write}) and max_step <= "
                           f"{INT32_MAX}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ConfigError(f"dtype={describe(self.dtype)}: must be one of {sorted(DTYPES)}")
        for name in ("k_scale", "v_scale"):
            object.__setattr__(self, name, _layer_scales(name, getattr(self, name),
                                                         len(layers), self.dtype))
        for i, spec in enumerate(layers):
            spec.kind.validate(i, self)
        _check_pages(self)
        _check_states(self)

    def _set_int(self, name: str, value, lo: int, hi: int | None = None, rule: str = "") -> int:
        """Field `name` checked (`_require_int`) and kept as a Python int (a NumPy integer
        given for it is converted: every rule and every use afterwards sees an int)."""
        value = _require_int(name, value, lo, hi, rule)
        object.__setattr__(self, name, value)
        return value

    def source(self, layer: int) -> int:
        """The layer whose K/V `layer` reads: its producer for a shared layer, else itself."""
        return self.layers[layer].kind.source(layer)

    @cached_property
    def kinds(self) -> tuple:
        """Each layer's kind (`LayerSpec.kind`)."""
        return tuple(spec.kind for spec in self.layers)

    @cached_property
    def reads(self) -> tuple:
        """Per layer, the kind whose K/V it reads, mask and rows included: a shared
        layer's producer's, any other layer's own."""
        return tuple(self.kinds[self.source(i)] for i in range(self.n_layers))

    @cached_property
    def mask_codes(self) -> tuple:
        """Per layer, its mask as the kernels take it (`masks.key_range`): 0 every key, W
        a sliding window, -C chunks of C (a shared layer: its producer's)."""
        return tuple(kind.mask_code for kind in self.reads)

    @cached_property
    def layer_shapes(self) -> tuple:
        """Each layer's `LayerShape` (a shared layer's is its producer's), the config's
        `n_kv_heads` and `head_dim` where a layer sets none."""
        shapes = []
        for layer in range(len(self.layers)):
            spec = self.layers[self.source(layer)]
            heads = self.n_kv_heads if spec.n_kv_heads is None else spec.n_kv_heads
            dim = self.head_dim if spec.head_dim is None else spec.head_dim
            shapes.append(LayerShape(heads, dim, dim if spec.v_head_dim is None else
                                     spec.v_head_dim, spec.kind.v_in_k))
        return tuple(shapes)

    @cached_property
    def state_layers(self) -> tuple:
        """The indices of the state layers (`state()`), in order."""
        return tuple(i for i, spec in enumerate(self.layers) if spec.keeps_state)

    @property
    def storing_layers(self) -> tuple:
        """The indices of the layers that hold K/V of their own (all but shared ones)."""
        return tuple(i for i, spec in enumerate(self.layers) if spec.stores)

    def ring_rows(self) -> np.ndarray:
        """`R` per layer (int64 `[n_layers]`), 0 for a layer paged by position, a shared
        layer's its producer's (`kinds`: `rows`)."""
        return np.array([kind.rows(self.max_write, self.capacity) for kind in self.reads],
                        np.int64)

    @cached_property
    def page_groups(self) -> tuple:
        """The `PageGroup`s of the storing layers, the one paged by position first, then
        the rings by size."""
        members: dict = {}
        rows_of = self.ring_rows().tolist()
        for layer in self.storing_layers:
            members.setdefault(int(rows_of[layer]), []).append(layer)
        itemsize = self.storage_dtype.itemsize
        return tuple(PageGroup(self.kinds[layers[0]], rows, tuple(layers),
                               self.table_pages(rows), *self.group_pages(rows),
                               sum(self.kinds[i].position_bytes(self.layer_shapes[i], itemsize)
                                   for i in layers))
                     for rows, layers in sorted(members.items()))

    def sequence_pages(self, positions: int) -> tuple:
        """Per page group (`page_groups` order), the pages one sequence of `positions`
        positions holds (`kinds`: `sequence_pages`)."""
        return tuple(group.kind.sequence_pages(positions, group.table_pages, self.page_size)
                     for group in self.page_groups)

    @cached_property
    def floor_layers(self) -> tuple:
        """`(kind, rows, layer)` per distinct floor among the storing and state layers
        (`kinds`: `floor_key`): the kind, its rows and its first layer; empty when every
        floor is 0."""
        found: dict = {}
        rows_of = self.ring_rows().tolist()
        for layer in sorted(self.storing_layers + self.state_layers):
            kind, rows = self.kinds[layer], int(rows_of[layer])
            key = kind.floor_key(rows)
            if key is not None:
                found.setdefault(key, (kind, rows, layer))
        return tuple(found.values())

    def floor_of(self, high_water: int) -> tuple[int, int]:
        """`(floor, layer)` of a sequence at `high_water`: the highest of its layers'
        floors (`kinds`: `floor`) and the layer that sets it, or `(0, -1)` when every
        floor is 0 (contract §5)."""
        floor, layer = 0, -1
        for kind, rows, first in self.floor_layers:
            f = kind.floor(high_water, rows, self.max_write)
            if f > floor or layer < 0:
                floor, layer = f, first
        return floor, layer

    def resumed_high_water(self, position: int) -> int:
        """The high-water of a sequence resumed at `position` from the prefix index: the
        highest its page groups' and state layers' kinds need (`kinds`:
        `resumed_high_water`)."""
        kinds = [group.kind for group in self.page_groups] + \
            [self.kinds[i] for i in self.state_layers[:1]]
        return max(kind.resumed_high_water(position, self.max_write) for kind in kinds)

    def table_pages(self, rows: int) -> int:
        """Pages per sequence of a page group: `ceil(capacity / P)` for flat layers (rows
        0), `ceil(R / P)` for ring layers of `R` rows."""
        return pages_for(rows or self.capacity, self.page_size)

    def group_pages(self, rows: int) -> tuple[int, int]:
        """`(initial, max)` pages of the pool of one page group (rows 0: paged by
        position, else a ring of R).

        Defaults: initially one sequence's worth (`min(capacity, 256)` positions on the flat
        group, one ring on a ring group) plus the scratch page; at most every sequence at its
        worst (`max_seqs` tables full) plus the scratch page, so the pool never binds
        (within the int32 slot bound); a ring group's bound also has a page for each page
        of positions the prefix index can hold (as many as the flat group's bound: the
        ring rows of its entries). A given `initial_pages` past that default bound is
        capped at it (on a ring group, at the sequences' rings: the index's pages come
        by growth): the pool never needs more."""
        table_pages = self.table_pages(rows)
        bound = INT32_MAX // self.page_size
        index_pages = self.max_seqs * self.table_pages(0) if rows else 0
        most = self.max_pages if self.max_pages is not None else \
            min(bound, self.max_seqs * table_pages + 1 + index_pages)
        first = pages_for(min(self.capacity, INITIAL_POSITIONS), self.page_size) \
            if not rows else table_pages
        initial = first + 1 if self.initial_pages is None else self.initial_pages
        if rows and self.max_pages is None:   # the sequences' rings; the index's rows
            initial = min(initial, self.max_seqs * table_pages + 1)   # come by growth
        return min(initial, most), most

    def fixed_pool(self, nbytes: int) -> "CacheConfig":
        """This config with a fixed pool (`initial_pages == max_pages`) of as many pages per
        page group as fit `nbytes` bytes: each page id is a page in every layer, `page_size
        x bytes_per_token` bytes, so `n = nbytes // (page_size x bytes_per_token)`.
        `ConfigError` for a cache of state layers alone: it has no page pool (its bytes are
        `bytes_per_sequence` a slot)."""
        n = _fixed_pages(self, nbytes)
        return replace(self, initial_pages=n, max_pages=n)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer of the config's own shape (`n_kv_heads`,
        `head_dim`), K and V; a layer of its own shape: `layer_shapes[i].position_bytes`
        times `page_size`."""
        return 2 * self.page_size * self.n_kv_heads * self.head_dim * self.storage_dtype.itemsize

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype of the storage's device arrays (bfloat16: uint16 bit patterns)."""
        return np.dtype(DTYPES[self.dtype])

    @property
    def state_storage_dtype(self) -> np.dtype:
        """The dtype of the state layers' states and snapshots (bfloat16: uint16 bits)."""
        return np.dtype(DTYPES[self.state_dtype])

    @property
    def is_fp8(self) -> bool:
        """Whether the storage is 8-bit floats (scaled: `k_scale`, `v_scale`)."""
        return self.dtype in FP8_DTYPES

    @property
    def np_dtype(self) -> np.dtype:
        """The storage dtype on the host (`sequence_kv`): bfloat16 as `ml_dtypes.bfloat16`,
        fp8 as `ml_dtypes.float8_e4m3fn` / `float8_e5m2`, the stored (unscaled) values
        (NumPy has neither: `ConfigError` naming the extra without ml_dtypes; PyTorch
        tensors in and out never need it)."""
        return _host_dtype(self.dtype, self.storage_dtype)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_sequence(self) -> int:
        """Bytes one sequence holds on the state layers whatever its length (contract §17:
        each layer's conv window ring, live and base states and input log; `kinds.state`):
        what a sequence slot costs beside `bytes_per_token` per position."""
        return _state_bytes(self, snapshot=False)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one prefix snapshot over the state layers (each layer's state in
        `state_dtype` and its conv window: `kinds.state`), 0 without state layers."""
        return _state_bytes(self, snapshot=True)

    @property
    def snapshot_interval(self) -> int:
        """Positions between the prefix index's snapshots (`state_interval`, or its
        default: the fewest whole pages holding at least `snapshot_bytes` of K/V; with no
        layer storing K/V, `capacity` in whole pages: no grid, a snapshot only at the last
        whole page of each registration)."""
        return _snapshot_interval(self)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one position of one sequence over the layers that store, K and V (a
        shared or state layer adds nothing: `bytes_per_sequence`)."""
        itemsize = self.storage_dtype.itemsize
        return sum(kind.position_bytes(shape, itemsize)
                   for kind, shape in zip(self.kinds, self.layer_shapes))
