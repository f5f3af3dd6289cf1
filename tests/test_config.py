"""Every invalid configuration field is refused with ConfigError naming the field."""
import pytest

import kvnumba as kv


def make(**overrides):
    base = dict(layers=[kv.flat(), kv.ring(window=4)], n_kv_heads=2, head_dim=8, capacity=64,
                max_seqs=4, max_write=4, max_step=8, dtype="float32", initial_rows=16)
    base.update(overrides)
    return kv.CacheConfig(**base)


def test_valid_config_keeps_its_fields():
    c = make()
    assert c.n_layers == 2 and c.layers[1].window == 4 and not c.layers[0].is_ring
    assert c.np_dtype.itemsize == 4
    assert kv.CacheConfig().initial_rows == 256


@pytest.mark.parametrize("field,value", [
    ("capacity", 0), ("capacity", -3), ("capacity", 2.5),
    ("max_seqs", 0), ("n_kv_heads", 0), ("head_dim", 0), ("head_dim", 257),
    ("max_write", 0), ("max_write", 65), ("max_step", 3), ("initial_rows", 0),
    ("dtype", "int8"), ("dtype", "float64"), ("layers", []), ("layers", ["flat"]),
    ("max_seqs", True),
])
def test_invalid_field_is_refused_by_name(field, value):
    with pytest.raises(kv.ConfigError) as err:
        make(**{field: value})
    assert field.split("_")[0] in str(err.value)


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


def test_sizing_is_bytes_of_each_layer_times_columns():
    c = make(dtype="float16")       # flat + ring(4), 2 kv heads, d 8, 4 seqs, max_write 4
    assert c.bytes_per_token == 2 * 2 * 2 * 8 * 2
    per_row = 5 * 2 * 2 * 8 * 2     # 5 columns (4 + scratch), K and V
    assert c.nbytes_at(16) == per_row * (16 + 7)          # ring R = 4 + 4 - 1
    assert c.nbytes_at(64, columns=1) == per_row // 5 * (64 + 7)
    cache = kv.BatchedSequenceCache(c)
    assert cache.nbytes == c.nbytes_at(16)                # initial_rows 16


def test_flat_growth_grows_every_column():
    """The documented example: 2 flat layers x 8 kv heads x 128 x fp16 x 33 columns."""
    c = kv.CacheConfig(layers=[kv.flat(), kv.flat()], n_kv_heads=8, head_dim=128,
                       capacity=4096, max_seqs=32, dtype="float16", initial_rows=256)
    assert c.nbytes_at(256) == 69_206_016          # 69 MB at start
    assert c.nbytes_at(2048) == 553_648_128        # 554 MB once one sequence reached 2048


def test_storage_rows_of_4_gib_are_refused_up_front():
    """The kernels stride rows in 32-bit bytes: the largest max_seqs whose row (max_seqs + 1
    columns x heads x head_dim x bytes) stays under 4 GiB is accepted, one more is not."""
    per_column = 8 * 128 * 2                    # 8 kv heads x head_dim 128, float16
    largest = 2**32 // per_column - 2           # (largest + 1) columns: 4 GiB - one column
    make(n_kv_heads=8, head_dim=128, dtype="float16", max_seqs=largest)
    with pytest.raises(kv.ConfigError, match=r"4294967296 bytes.*under 4 GiB"):
        make(n_kv_heads=8, head_dim=128, dtype="float16", max_seqs=largest + 1)
