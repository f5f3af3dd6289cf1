"""PyTorch on a CUDA GPU: the cache on PyTorch's stream, and a decode step in a CUDA graph.

Skipped without a GPU or without PyTorch built with CUDA (the simulator has no
`__cuda_array_interface__` and no streams to capture).
"""
import numpy as np
import pytest

import kvnumba as kv
from kvnumba import device
from kvnumba.kernels.launch.calling import device_pointer
from oracle import dense_attention

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(device.SIMULATOR or not torch.cuda.is_available(),
                                reason="needs a CUDA GPU and PyTorch with CUDA")

H, HQ, D = 2, 8, 64
B, HISTORY = 4, 300


def make(stream):
    config = kv.CacheConfig(layers=[kv.flat(), kv.ring(window=128)], n_kv_heads=H,
                            head_dim=D, capacity=1024, max_seqs=B, max_write=64,
                            max_step=256, dtype="float16")
    return kv.BatchedSequenceCache(config, stream=device.cuda.external_stream(
        stream.cuda_stream))


def filled(cache, rng):
    """Every sequence at HISTORY positions; returns each one's K/V per layer (host)."""
    hist = {s: ([], []) for s in range(B)}
    for s in range(B):
        cache.seq_new()
    for start in range(0, HISTORY, 64):
        n = min(64, HISTORY - start)
        cache.declare_step(np.repeat(np.arange(B), n))
        cache.prepare_step()
        for layer in range(2):
            k = rng.standard_normal((B * n, H, D)).astype(np.float16)
            v = rng.standard_normal((B * n, H, D)).astype(np.float16)
            cache.write(layer, k, v)
            if layer == 0:
                for s in range(B):
                    hist[s][0].append(k[s * n:(s + 1) * n])
                    hist[s][1].append(v[s * n:(s + 1) * n])
        cache.commit_step()
    return {s: (np.concatenate(ks), np.concatenate(vs)) for s, (ks, vs) in hist.items()}


def reference(hist, q, k, v):
    """float64 decode attention of each sequence's new token over its flat-layer history."""
    out = np.zeros(q.shape)
    for s in range(B):
        keys = np.concatenate([hist[s][0], k[s:s + 1]])
        values = np.concatenate([hist[s][1], v[s:s + 1]])
        out[s] = dense_attention(q[s:s + 1], keys, values, len(hist[s][0]), None, False,
                                 1 / np.sqrt(D))[0]
    return out


def test_a_decode_step_is_captured_in_a_cuda_graph_and_replayed_for_later_steps():
    """Capture write + attend once; replay it for the next steps while the plan's launch
    key stays the same (the graph reads each step's freshly staged tables)."""
    rng = np.random.default_rng(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cache = make(stream)
        hist = filled(cache, rng)
        q = torch.zeros(B, HQ, D, dtype=torch.float16, device="cuda")
        k = torch.zeros(B, H, D, dtype=torch.float16, device="cuda")
        v = torch.zeros_like(k)
        out = torch.zeros_like(q)
        plan = cache.declare_step(np.arange(B))
        cache.prepare_step()
        cache.update_and_attend(0, q, k, v, out=out)      # warm: compiled, workspace grown
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            cache.write(0, k, v)
            cache.attend(0, q, out=out)
        key = plan.launch_key
        for step in range(3):
            if step:
                plan = cache.declare_step(np.arange(B))
                cache.prepare_step()
                assert plan.launch_key == key
            host = [rng.standard_normal(t.shape).astype(np.float16) for t in (q, k, v)]
            for tensor, values in zip((q, k, v), host):
                tensor.copy_(torch.from_numpy(values))
            graph.replay()
            cache.write(1, k, v)                          # the ring layer, outside the graph
            stream.synchronize()
            want = reference(hist, *host)
            got = out.float().cpu().numpy()
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3, step
            cache.commit_step()
            for s in range(B):                            # the new token joins the history
                hist[s] = (np.concatenate([hist[s][0], host[1][s:s + 1]]),
                           np.concatenate([hist[s][1], host[2][s:s + 1]]))


def test_kernels_and_matmuls_on_torchs_stream_stay_ordered_without_a_sync():
    """A matmul consumes attend's output on the same stream, with no synchronize between."""
    rng = np.random.default_rng(1)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cache = make(stream)
        hist = filled(cache, rng)
        host = [rng.standard_normal(shape).astype(np.float16)
                for shape in ((B, HQ, D), (B, H, D), (B, H, D))]
        q, k, v = (torch.from_numpy(a).cuda() for a in host)
        weight = torch.randn(D, D, dtype=torch.float16, device="cuda")
        torch.cuda._sleep(10_000_000)          # a long kernel ahead: a missing wait would show
        cache.declare_step(np.arange(B))
        cache.prepare_step()
        out = cache.update_and_attend(0, q, k, v, out=torch.empty_like(q))
        projected = out @ weight                 # PyTorch, same stream, no synchronize
        cache.write(1, k, v)
        cache.commit_step()
        stream.synchronize()
    want = reference(hist, *host) @ weight.double().cpu().numpy()
    got = projected.double().cpu().numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3


def test_the_driver_names_the_device_of_a_cuda_pointer():
    """`pointer_device` asks the driver: a tensor's and a Numba array's memory are on
    the current GPU; host memory is on none."""
    current = torch.cuda.current_device()
    assert device.pointer_device(torch.zeros(4, device="cuda").data_ptr()) == current
    assert device.pointer_device(
        device.cuda.device_array(4).__cuda_array_interface__["data"][0]) == current
    assert device.pointer_device(np.zeros(4).ctypes.data) is None


@pytest.mark.skipif(device.SIMULATOR or torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs")
def test_a_cache_on_the_second_gpu_refuses_a_tensor_on_the_first_and_serves_its_own():
    """Built and called with GPU 0 current: storage, launches and output on GPU 1."""
    config = kv.CacheConfig(layers=[kv.flat()], n_kv_heads=H, head_dim=D, capacity=16,
                            max_seqs=1, max_write=4, max_step=4, dtype="float16")
    torch.cuda.set_device(0)
    cache = kv.BatchedSequenceCache(config, device=1)
    assert device.pointer_device(device_pointer(cache.layer_data(0)[0])) == 1
    cache.declare_step([cache.seq_new()])
    cache.prepare_step()
    q, k, v = (torch.randn(1, heads, D, dtype=torch.float16, device="cuda:1")
               for heads in (HQ, H, H))
    with pytest.raises(kv.ShapeError, match="q: the array is on cuda:0, the cache on cuda:1"):
        cache.update_and_attend(0, q.to("cuda:0"), k, v)
    out = cache.update_and_attend(0, q, k, v)
    assert out.device == q.device and torch.cuda.current_device() == 0
    # one key: the output is that key's value, for every q head of its group
    want = v.repeat_interleave(HQ // H, dim=1)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-3)
    cache.commit_step()
