"""The kernel benchmarks' peers: PyTorch's attention (SDPA and FlashAttention varlen) on
the cache's own data, where PyTorch with CUDA is installed."""
from __future__ import annotations

import sys

import numpy as np

from .harness import Bench
from .sizes import ratio


class Peers:
    """PyTorch's attention on the cache's own data: SDPA and FlashAttention varlen."""

    def __init__(self, bench: Bench):
        self.bench = bench
        self.torch = bench.torch
        self.sizes = bench.sizes

    def tensor(self, array, dtype):
        """A torch view of a device array of elements `dtype` (the cache's bfloat16
        storage: uint16 bits), or the tensor itself."""
        torch = self.torch
        if isinstance(array, torch.Tensor):
            return array
        if dtype == "bfloat16":
            return torch.as_tensor(array.view(np.int16), device="cuda").view(torch.bfloat16)
        return torch.as_tensor(array, device="cuda")

    def packed_kv(self, cache, layer, seqs, lengths):
        """`[sum(lengths), n_kv_heads, d]` K and V of each sequence's positions in order
        (ring layers: the last `lengths` positions, unwrapped), and `cu_seqlens_k`."""
        torch = self.torch
        config = cache.config
        ring = int(config.ring_rows()[layer])
        page = config.page_size
        k_store, v_store = (self.tensor(a, config.dtype).reshape(-1, config.n_kv_heads,
                                                                 config.head_dim)
                            for a in cache.layer_data(layer))     # slots [pages x page]
        parts_k, parts_v = [], []
        for seq, length in zip(seqs, lengths):
            end = cache.pos(seq)
            positions = torch.arange(end - length, end, device="cuda")
            rows = positions % ring if ring else positions
            table = torch.as_tensor(cache.page_table(seq, layer).astype(np.int64),
                                    device="cuda")
            slots = table[rows // page] * page + rows % page
            parts_k.append(k_store[slots])
            parts_v.append(v_store[slots])
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32, device="cuda")
        cu[1:] = torch.cumsum(torch.as_tensor(lengths, device="cuda"), 0)
        return torch.cat(parts_k), torch.cat(parts_v), cu

    def flash_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, window=None):
        """`(ms, out)` of FlashAttention varlen through `torch.ops.aten`, or (None, None)."""
        torch = self.torch
        kw = dict(scale=None)
        if window:
            kw.update(window_size_left=window - 1, window_size_right=0)
        op = torch.ops.aten._flash_attention_forward

        def call():
            return op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, **kw)[0]

        try:
            out = call()
        except (RuntimeError, TypeError) as exc:  # an old PyTorch, or no flash kernels
            print(f"  (FlashAttention varlen unavailable: {exc})", file=sys.stderr)
            return None, None
        return self.bench.gpu_ms(call), out

    def flash_figures(self, ms, ours, dtype, *flash_args, **flash_kw) -> dict:
        """FlashAttention varlen (`flash_varlen(*flash_args, **flash_kw)`) against kvnumba's
        `ms` and output `ours`: its ms, the ratio and, where it ran, the largest |difference|."""
        flash_ms, flash_out = self.flash_varlen(*flash_args, **flash_kw)
        figures = dict(flash_ms=flash_ms, vs_flash=ratio(flash_ms, ms))
        if flash_out is not None:
            figures["max_abs_diff"] = self.max_diff(ours, dtype, flash_out)
        return figures

    def sdpa(self, q, k, v, **kw):
        """SDPA with native GQA (PyTorch 2.5+)."""
        return self.torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                                    **kw)

    def max_diff(self, ours, dtype, theirs):
        """The largest |difference| of kvnumba's output `ours` and a peer's."""
        return (self.tensor(ours, dtype).float() - theirs.float()).abs().max().item()
