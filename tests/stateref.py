"""float64 references of the state layers' mixers, written from their definitions token
by token for one sequence (no code shared with the kernels).

- `conv_ref(inputs, weight, bias, silu)`: the causal convolution's output at every
  position of a sequence whose inputs, position by position, are `inputs [P, C]`;
- `delta_rule_ref(q, k, v, g, beta, scale, qk_l2norm, S0)`: the gated delta rule over a
  sequence's tokens from state `S0` (None: zero), its outputs and final state.
"""
import numpy as np


def conv_ref(inputs, weight, bias, silu):
    """`out [P, C]`: `out[p, c] = act(bias[c] + sum_{j<K} weight[c, j] * x[p - K + 1 +
    j, c])`, `x[q] = 0` for `q < 0`, act SiLU or identity; `bias` None is no bias."""
    x = np.asarray(inputs, np.float64)
    w = np.asarray(weight, np.float64)
    n_pos, channels = x.shape
    taps = w.shape[1]
    out = np.zeros((n_pos, channels))
    for p in range(n_pos):
        for c in range(channels):
            acc = 0.0 if bias is None else float(bias[c])
            for j in range(taps):
                q = p - taps + 1 + j
                if q >= 0:
                    acc += w[c, j] * x[q, c]
            if silu:
                acc = acc / (1.0 + np.exp(-acc))
            out[p, c] = acc
    return out


def _l2norm(x):
    return x / np.sqrt(np.sum(x * x) + 1e-6)


def delta_rule_ref(q, k, v, g, beta, scale, qk_l2norm, S0=None):
    """`(out [T, H, Dv], S [H, Dk, Dv])` for tokens `q, k [T, H, Dk]`, `v [T, H, Dv]`, `g
    [T, H]` or `[T, H, Dk]` (log-decay), `beta [T, H]` or None, from `S0 [H, Dk, Dv]`
    (None: zero). Per token and head: normalise q, k when asked; `S <- diag(exp(g)) S`;
    with beta `S <- S + beta k (v - S^T k)^T`, without `S <- S + k v^T`; `o = scale S^T
    q`."""
    q, k, v, g = (np.asarray(a, np.float64) for a in (q, k, v, g))
    n_tok, n_heads, dk = q.shape
    dv = v.shape[2]
    S = np.zeros((n_heads, dk, dv)) if S0 is None else np.array(S0, np.float64)
    out = np.zeros((n_tok, n_heads, dv))
    for t in range(n_tok):
        for h in range(n_heads):
            qt, kt = q[t, h], k[t, h]
            if qk_l2norm:
                qt, kt = _l2norm(qt), _l2norm(kt)
            decay = np.exp(g[t, h]) if g.ndim == 2 else np.exp(g[t, h])[:, None]
            S[h] = decay * S[h]
            if beta is None:
                S[h] = S[h] + np.outer(kt, v[t, h])
            else:
                u = S[h].T @ kt
                S[h] = S[h] + float(beta[t, h]) * np.outer(kt, v[t, h] - u)
            out[t, h] = scale * (S[h].T @ qt)
    return out, S
