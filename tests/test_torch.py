"""PyTorch tensors in, PyTorch tensors out (CPU tensors here; CUDA ones in test_torch_gpu).

A CPU tensor reaches the kernels through NumPy without a copy and comes back as a
tensor of q's dtype; a tensor that requires grad, or a torch `out` of the wrong
shape or dtype, is refused before anything is written.
"""
import numpy as np
import pytest

import kvnumba as kv
from snapshot import assert_unchanged, snapshot

torch = pytest.importorskip("torch")
H, HQ, D = 1, 2, 16


def prepared(dtype="float16", tokens=3):
    config = kv.CacheConfig(layers=[kv.flat()], n_kv_heads=H, head_dim=D, capacity=16,
                            max_seqs=2, max_write=8, max_step=8, dtype=dtype,
                            initial_pages=8)
    c = kv.BatchedSequenceCache(config)
    s = c.seq_new()
    c.declare_step([s] * tokens)
    c.prepare_step(tokens + 1)
    return c


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_torch_in_torch_out_equal_to_numpy_in_numpy_out(dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, heads, D, generator=gen).to(dtype) for heads in (HQ, H, H))
    c = prepared("bfloat16" if dtype == torch.bfloat16 else "float16")
    got = c.update_and_attend(0, q, k, v)
    assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.device == q.device
    if dtype == torch.bfloat16:
        import ml_dtypes
        as_numpy = [t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) for t in (q, k, v)]
        want = c.update_and_attend(0, *as_numpy)
        assert got.view(torch.int16).numpy().tobytes() == want.tobytes()
    else:
        want = c.update_and_attend(0, q.numpy(), k.numpy(), v.numpy())
        assert got.numpy().tobytes() == want.tobytes()
    assert not got[3:].float().any()                       # the padding row


def test_a_torch_out_is_filled_and_returned():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, HQ, D, generator=gen, dtype=torch.float16)
    k = torch.randn(4, H, D, generator=gen, dtype=torch.float16)
    c = prepared()
    out = torch.full((4, HQ, D), float("nan"), dtype=torch.float32)
    got = c.update_and_attend(0, q, k, k, out=out)
    assert got is out and torch.isfinite(out).all()
    np.testing.assert_allclose(out.numpy(), c.attend(0, q.numpy()).astype(np.float32),
                               rtol=1e-3)


@pytest.mark.parametrize("bad", ["q", "k", "v", "out", "out_shape", "out_dtype"])
def test_tensors_that_need_grad_or_do_not_fit_are_refused_before_any_write(bad):
    gen = torch.Generator().manual_seed(2)
    args = dict(q=torch.randn(4, HQ, D, generator=gen), k=torch.randn(4, H, D, generator=gen),
                v=torch.randn(4, H, D, generator=gen), out=torch.zeros(4, HQ, D))
    if bad in ("q", "k", "v", "out"):
        args[bad].requires_grad_(True)
    elif bad == "out_shape":
        args["out"] = torch.zeros(4, HQ, D + 1)
    else:
        args["out"] = torch.zeros(4, HQ, D, dtype=torch.float64)
    c = prepared("float32")
    before = snapshot(c)
    with pytest.raises(kv.ShapeError, match="requires grad" if bad in args else "out"):
        c.update_and_attend(0, args["q"], args["k"], args["v"], out=args["out"])
    assert_unchanged(before, snapshot(c))


def test_torch_stream_needs_a_gpu():
    if kv.device.SIMULATOR:
        with pytest.raises(kv.DeviceError, match="CUDA GPU"):
            kv.torch_stream()
    else:
        stream = kv.torch_stream()
        assert stream.handle.value == torch.cuda.current_stream().cuda_stream
