"""Every invalid configuration field is refused with ConfigError naming the field."""
import pytest

import kvnumba as kv


def make(**overrides):
    base = dict(layers=[kv.flat(), kv.ring(window=4)], n_kv_heads=2, head_dim=8, capacity=64,
                max_seqs=4, max_write=4, max_step=8, dtype="float32", initial_pages=16)
    base.update(overrides)
    return kv.CacheConfig(**base)


def test_valid_config_keeps_its_fields():
    c = make()
    assert c.n_layers == 2 and c.layers[1].window == 4 and not c.layers[0].is_ring
    assert c.np_dtype.itemsize == 4
    d = kv.CacheConfig()
    assert (d.page_size, d.initial_pages, d.max_pages) == (16, None, None)


@pytest.mark.parametrize("field,value", [
    ("capacity", 0), ("capacity", -3), ("capacity", 2.5),
    ("max_seqs", 0), ("n_kv_heads", 0), ("head_dim", 0), ("head_dim", 513),
    ("max_write", 0), ("max_write", 65), ("max_step", 3), ("initial_pages", 0),
    ("max_pages", 0), ("page_size", 4), ("page_size", 12), ("page_size", 512),
    ("page_size", True), ("page_size", None), ("initial_pages", 1.5),
    ("dtype", "int8"), ("dtype", "float64"), ("layers", []), ("layers", ["flat"]),
    ("max_seqs", True),
])
def test_invalid_field_is_refused_by_name(field, value):
    with pytest.raises(kv.ConfigError) as err:
        make(**{field: value})
    assert field in str(err.value)


def test_page_rules_name_the_numbers():
    with pytest.raises(kv.ConfigError, match=r"page_size=24: requires a power of two from 8 "
                                             r"to 256"):
        make(page_size=24)
    with pytest.raises(kv.ConfigError, match=r"initial_pages=9: requires 1 <= initial_pages "
                                             r"<= max_pages \(8\)"):
        make(initial_pages=9, max_pages=8)
    # a pool's slots (max_pages x page_size) are int32 in the kernels
    make(page_size=256, max_pages=(2**31 - 1) // 256)
    with pytest.raises(kv.ConfigError, match=r"max_pages x page_size 256 slots"):
        make(page_size=256, max_pages=(2**31 - 1) // 256 + 1)


def test_page_tables_past_int32_are_refused():
    """(max_seqs + 1) x ceil(capacity / page_size) entries per kind must index as int32."""
    make(layers=[kv.flat()], capacity=2**30, max_write=8, page_size=8, max_seqs=14)
    with pytest.raises(kv.ConfigError, match=r"page tables would hold 2147483648 entries"):
        make(layers=[kv.flat()], capacity=2**30, max_write=8, page_size=8, max_seqs=15)


def test_default_pools_start_small_and_never_bind():
    c = kv.CacheConfig(layers=[kv.flat(), kv.ring(window=100)], capacity=1000, max_seqs=5,
                       max_write=20, max_step=40)
    # flat: ceil(min(1000, 256) / 16) = 16 pages + the scratch page; at most 5 sequences
    # of ceil(1000 / 16) = 63 pages, plus the scratch page
    assert c.table_pages(0) == 63 and c.group_pages(0) == (17, 5 * 63 + 1)
    # ring R = 100 + 20 - 1 = 119: ceil(119 / 16) = 8 pages a sequence, and a page for
    # each page of positions the prefix index can hold (the flat bound's 5 * 63)
    assert c.table_pages(119) == 8 and c.group_pages(119) == (9, 5 * 8 + 1 + 5 * 63)
    assert make(initial_pages=3, max_pages=7).group_pages(0) == (3, 7)


def test_max_write_above_capacity_names_the_rule():
    with pytest.raises(kv.ConfigError, match=r"max_write <= capacity \(8\)"):
        make(capacity=8, max_write=9, max_step=9)


def test_max_step_below_max_write_names_the_rule():
    with pytest.raises(kv.ConfigError, match=r"max_step >= max_write \(4\)"):
        make(max_step=3)


@pytest.mark.parametrize("window", [0, -1, 2.0, None])
def test_ring_window_refused_at_once(window):
    with pytest.raises(kv.ConfigError, match="window"):
        kv.ring(window=window)


def test_config_error_is_a_value_error():
    assert issubclass(kv.ConfigError, ValueError) and issubclass(kv.ConfigError, kv.KVCacheError)


def test_sizing_is_bytes_of_each_layer_times_pages():
    c = make(dtype="float16", page_size=8)   # flat + ring(4), 2 kv heads, d 8, 4 seqs, M 4
    assert c.bytes_per_token == 2 * 2 * 2 * 8 * 2           # layers x K,V x heads x d x 2 B
    assert c.page_bytes == 2 * 8 * 2 * 8 * 2                # K,V x page x heads x d x 2 B
    cache = kv.BatchedSequenceCache(c)
    # initial_pages 16: the flat pool's; the ring's (R = 7: 1 page a sequence) is capped at
    # its sequences' rings, 4 + the scratch page (the prefix index's pages come by growth)
    assert cache.nbytes == (16 + 5) * c.page_bytes
    assert cache.nbytes_held == 0
    a = cache.seq_new()                                     # its ring: ceil(7 / 8) = 1 page
    assert cache.nbytes_held == 1 * c.page_bytes
    cache.declare_step([a] * 4)
    cache.prepare_step()
    cache.abort_step()                                      # the step's page goes back
    assert cache.nbytes_held == 1 * c.page_bytes
    cache.seq_rm(a)
    assert cache.nbytes_held == 0


def test_fixed_pool_from_a_byte_budget():
    c = make(dtype="float16", page_size=8, initial_pages=None)
    per_page = 8 * c.bytes_per_token                        # a page id in every layer
    fixed = c.fixed_pool(10 * per_page + per_page - 1)
    assert (fixed.initial_pages, fixed.max_pages) == (10, 10)
    cache = kv.BatchedSequenceCache(fixed)
    assert cache.nbytes == 10 * per_page
    with pytest.raises(kv.ConfigError, match=r"at least 2 pages of 1024 bytes"):
        c.fixed_pool(2 * per_page - 1)
