"""float64 references of the state layers' mixers, written from their definitions token
by token for one sequence (no code shared with the kernels).

- `conv_ref(inputs, weight, bias, silu)`: the causal convolution's output at every
  position of a sequence whose inputs, position by position, are `inputs [P, C]`;
- `delta_rule_ref(q, k, v, g, beta, scale, qk_l2norm, S0)`: the gated delta rule over a
  sequence's tokens from state `S0` (None: zero), its outputs and final state;
- `ssd_ref(x, dt, A, B, C, D, dt_bias, softplus, limit)`: Mamba2's SSD over a sequence's
  tokens from the zero state, its outputs and final state `[H, head_dim, d_state]`.
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


def ssd_ref(x, dt, A, B, C, D, dt_bias, softplus, limit):
    """`(y [T, H, P], S [H, P, N])` for `x [T, H, P]`, `dt [T, H]`, `A [H]`, `B, C [T, G,
    N]`, `D [H]` or None, `dt_bias [H]` or None: per token and head `h` of group `h // (H
    / G)`, `d = clip(softplus(dt + dt_bias), *limit)` (`log(1 + e^x)`; none unless
    `softplus`), `S_h <- exp(d A_h) S_h + d outer(x_h, B_g)`, `y_h = S_h C_g + D_h x_h`."""
    x, dt, A, B, C = (np.asarray(a, np.float64) for a in (x, dt, A, B, C))
    n_tok, n_heads, head_dim = x.shape
    per_group = n_heads // B.shape[1]
    S = np.zeros((n_heads, head_dim, B.shape[2]))
    y = np.zeros_like(x)
    for t in range(n_tok):
        for h in range(n_heads):
            g = h // per_group
            d = dt[t, h] + (0.0 if dt_bias is None else float(dt_bias[h]))
            if softplus:
                d = np.logaddexp(0.0, d)
            d = min(max(d, limit[0]), limit[1])
            S[h] = np.exp(d * A[h]) * S[h] + d * np.outer(x[t, h], B[t, g])
            y[t, h] = S[h] @ C[t, g] + (0.0 if D is None else float(D[h]) * x[t, h])
    return y, S
