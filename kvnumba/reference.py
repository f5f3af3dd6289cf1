"""A NumPy oracle: dense float64 attention with explicit masks, and the demo model without a cache.

Nothing here touches a device or a cache object. The masks are written out from
the definitions of contract §2 and §7, position by position:

* causal, window `W` (None for a flat layer): the query at position `p` sees the
  keys `max(0, p - W + 1) <= j <= p` (FlashAttention's `window_size=(W - 1, 0)`,
  Hugging Face's `sliding_window=W`);
* causal, chunks of `C` (contract §15): the keys `C * (p // C) <= j <= p`, its own
  chunk up to itself (Hugging Face's `attention_chunk_size=C`);
* a draft block `[b0, b1)`: each of its queries sees every key of the block,
  whatever the window, plus the history its own window or chunk allows
  (`lo(p) <= j < b0`).

`DemoModel` is the small decoder of `python -m kvnumba demo`. Its per-token
pieces (embedding, norms, projections with rotary positions, MLP, output head)
are shared by the cached run (which attends through the cache) and by
`DemoModel.forward`, which runs one session's whole token history through dense
float64 attention with no cache at all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


# ---------------------------------------------------------------------------- masks
def visible(p: int, j: int, window: int | None = None, block: tuple | None = None,
            chunk: int | None = None) -> bool:
    """Does the query at position `p` see the key at position `j`?

    `window`: W, or None. `chunk`: C, or None (at most one of the two; neither: a flat
    layer). `block`: the `(b0, b1)` draft block `p` belongs to, or None.
    """
    lo = 0
    if window is not None:
        lo = max(0, p - window + 1)
    if chunk is not None:
        lo = (p // chunk) * chunk
    if block is not None:
        b0, b1 = block
        return b0 <= j < b1 or lo <= j < b0
    return lo <= j <= p


def mask(q_positions, n_keys: int, window: int | None = None, blocks=(),
         chunk: int | None = None) -> np.ndarray:
    """`[len(q_positions), n_keys]` bool: which keys (positions `0 .. n_keys-1`) each query sees.

    `blocks`: `(b0, b1)` draft-block spans; a query inside one uses the block rule.
    `window`, `chunk`: as `visible` takes them.
    """
    q_positions = np.asarray(q_positions, dtype=np.int64)
    out = np.zeros((q_positions.size, n_keys), dtype=bool)
    for i, p in enumerate(q_positions):
        span = next(((b0, b1) for b0, b1 in blocks if b0 <= p < b1), None)
        for j in range(n_keys):
            out[i, j] = visible(int(p), j, window, span, chunk)
    return out


def attention(q, k, v, q_positions=None, *, window: int | None = None, blocks=(),
              scale: float | None = None, softcap: float | None = None,
              sinks=None, chunk: int | None = None) -> np.ndarray:
    """Dense float64 attention of one sequence.

    q: `[n_q, n_q_heads, d]` at `q_positions` (default `0 .. n_q-1`); k, v: `[n_keys,
    n_kv_heads, d]` at positions `0 .. n_keys-1`. Query head `h` reads kv head
    `h // (n_q_heads // n_kv_heads)`. Scores are scaled (default `1/sqrt(d)`), then
    soft-capped (`c * tanh(s / c)`), masked (`window` or `chunk`, `blocks`: `mask`),
    soft-maxed. `sinks` (`[n_q_heads]`): each
    head's logit joins its softmax as one more key whose value is zero. Returns `[n_q,
    n_q_heads, d]`.
    """
    s = _with_sinks(_scores(q, k, q_positions, window, blocks, scale, softcap, chunk), sinks)
    group = s.shape[0] // np.shape(v)[1]
    vh = np.repeat(np.asarray(v, np.float64), group, axis=1)            # [n_keys, hq, d]
    s = s - s.max(axis=-1, keepdims=True)
    w = np.exp(s)
    w /= w.sum(axis=-1, keepdims=True)
    n_keys = vh.shape[0]
    return np.einsum("hqk,khd->qhd", w[..., :n_keys], vh)


def log_sum_exp(q, k, q_positions=None, *, window: int | None = None, blocks=(),
                scale: float | None = None, softcap: float | None = None,
                sinks=None, chunk: int | None = None) -> np.ndarray:
    """`[n_q, n_q_heads]` float64: each query row's natural-log log-sum-exp of its final
    scores (scaled, soft-capped, over the keys it sees, and its head's sink), what
    `attend(..., lse=)` writes; arguments as `attention`'s."""
    s = _with_sinks(_scores(q, k, q_positions, window, blocks, scale, softcap, chunk), sinks)
    best = s.max(axis=-1, keepdims=True)
    return (best[..., 0] + np.log(np.exp(s - best).sum(axis=-1))).T


def _with_sinks(s: np.ndarray, sinks) -> np.ndarray:
    """Scores `[n_q_heads, n_q, n_keys]` with each head's sink appended as a last column
    (`None`: unchanged)."""
    if sinks is None:
        return s
    column = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], s.shape[:2] + (1,))
    return np.concatenate([s, column], axis=-1)


def _scores(q, k, q_positions, window, blocks, scale, softcap, chunk) -> np.ndarray:
    """`[n_q_heads, n_q, n_keys]` float64 scores, scaled, soft-capped and masked (-inf)."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    n_q, n_q_heads, d = q.shape
    n_keys, n_kv_heads, _ = k.shape
    if n_q_heads % n_kv_heads:
        raise ValueError(f"n_q_heads {n_q_heads} is not a multiple of n_kv_heads {n_kv_heads}")
    group = n_q_heads // n_kv_heads
    if q_positions is None:
        q_positions = np.arange(n_q)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    seen = mask(q_positions, n_keys, window, blocks, chunk)                  # [n_q, n_keys]
    kh = np.repeat(k, group, axis=1)                                     # [n_keys, hq, d]
    s = scale * np.einsum("qhd,khd->hqk", q, kh)                         # [hq, n_q, n_keys]
    if softcap:
        s = softcap * np.tanh(s / softcap)
    return np.where(seen[None], s, -np.inf)


# ---------------------------------------------------------------------------- the demo model
def rms_norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x: np.ndarray, positions, base: float = 10000.0) -> np.ndarray:
    """Rotary position embedding of `x [n, heads, d]` (d even) at absolute `positions [n]`."""
    n, _, d = x.shape
    half = d // 2
    freq = base ** (-np.arange(half, dtype=np.float64) / half)
    angle = np.asarray(positions, np.float64)[:, None] * freq[None, :]   # [n, half]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


@dataclass
class DemoModel:
    """A tiny decoder with random weights: embedding, L pre-norm layers (GQA attention with
    rotary positions, a ReLU MLP, residuals), a final norm and an output head.

    `windows[layer]` is None (a flat layer) or W (a sliding-window layer).
    """

    vocab: int
    d_model: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    windows: tuple
    weights: dict

    @classmethod
    def random(cls, seed: int = 0, *, vocab: int = 64, d_model: int = 32, n_q_heads: int = 4,
               n_kv_heads: int = 2, head_dim: int = 8, windows=(None, 6), mlp: int = 64):
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim}: rotary positions need an even head_dim")
        rng = np.random.default_rng(seed)

        def init(*shape, fan_in):
            return rng.standard_normal(shape) / math.sqrt(fan_in)

        w = {"embed": rng.standard_normal((vocab, d_model)),
             "head": init(d_model, vocab, fan_in=d_model) * 3.0}
        for layer in range(len(windows)):
            w[f"wq{layer}"] = init(d_model, n_q_heads * head_dim, fan_in=d_model)
            w[f"wk{layer}"] = init(d_model, n_kv_heads * head_dim, fan_in=d_model)
            w[f"wv{layer}"] = init(d_model, n_kv_heads * head_dim, fan_in=d_model)
            w[f"wo{layer}"] = init(n_q_heads * head_dim, d_model, fan_in=n_q_heads * head_dim)
            w[f"w1{layer}"] = init(d_model, mlp, fan_in=d_model)
            w[f"w2{layer}"] = init(mlp, d_model, fan_in=mlp)
        return cls(vocab, d_model, n_q_heads, n_kv_heads, head_dim, tuple(windows), w)

    @property
    def n_layers(self) -> int:
        return len(self.windows)

    # -- per-token pieces (shared by the cached run and the cache-free forward) --
    def embed(self, tokens) -> np.ndarray:
        return self.weights["embed"][np.asarray(tokens, dtype=np.int64)]

    def qkv(self, layer: int, x: np.ndarray, positions):
        """q `[n, n_q_heads, d]`, k and v `[n, n_kv_heads, d]` of the layer's input
        `x [n, d_model]`."""
        h = rms_norm(x)
        n = x.shape[0]
        q = (h @ self.weights[f"wq{layer}"]).reshape(n, self.n_q_heads, self.head_dim)
        k = (h @ self.weights[f"wk{layer}"]).reshape(n, self.n_kv_heads, self.head_dim)
        v = (h @ self.weights[f"wv{layer}"]).reshape(n, self.n_kv_heads, self.head_dim)
        return rope(q, positions), rope(k, positions), v

    def after_attention(self, layer: int, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """The layer's output: residual + attention projection, then residual + MLP."""
        n = x.shape[0]
        x = x + np.asarray(attn, np.float64).reshape(n, -1) @ self.weights[f"wo{layer}"]
        hidden = np.maximum(rms_norm(x) @ self.weights[f"w1{layer}"], 0.0)
        return x + hidden @ self.weights[f"w2{layer}"]

    def logits(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x) @ self.weights["head"]

    # -- the oracle --
    def forward(self, tokens, blocks=()):
        """Cache-free forward of one session's whole history `tokens` (positions `0 .. n-1`).

        `blocks`: `(b0, b1)` spans of the history that were fed as draft blocks.
        Returns `(attn, logits)`: per layer the attention output `[n, n_q_heads, d]`
        (float64, dense masks), and the logits `[n, vocab]`.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.arange(tokens.size)
        x = self.embed(tokens)
        attns = []
        for layer, window in enumerate(self.windows):
            q, k, v = self.qkv(layer, x, positions)
            a = attention(q, k, v, positions, window=window, blocks=blocks)
            attns.append(a)
            x = self.after_attention(layer, x, a)
        return attns, self.logits(x)
