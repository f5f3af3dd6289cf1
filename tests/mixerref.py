"""A reference for the state layer's ops (`conv`, `delta_rule`, `ssd`), written from their
definitions: float64, token by token, each token from its own sequence's state.

`RefOps` is one state layer's ops. By default every token of a call belongs to sequence
0 at the positions after its earlier calls; `seqs(ids)` names the sequence of each token
of the next call (a packed step), and each sequence continues from what its earlier
tokens left (its conv inputs, its delta-rule or SSD state), whatever the calls' split.
"""
import torch


class RefOps:
    """One state layer's `conv` and `delta_rule` or `ssd` over any number of sequences."""

    def __init__(self):
        self.history = {}      # seq -> list of conv inputs [C] (float64), from position 0
        self.states = {}       # seq -> delta-rule [H, Dk, Dv] or SSD [H, P, N] state (float64)
        self._ids = None
        self.calls = {"conv": 0, "delta_rule": 0, "ssd": 0}

    def seqs(self, ids):
        """The sequence of each token of the next op calls (until changed)."""
        self._ids = list(ids)
        return self

    def _owners(self, T):
        ids = [0] * T if self._ids is None else self._ids
        assert len(ids) == T, f"{T} tokens, {len(ids)} sequence ids"
        return ids

    def conv(self, x, weight, bias=None, activation=None):
        """`y_t = act(bias + sum_j weight[:, j] * x[p - K + 1 + j])` over the token's own
        sequence's inputs, zeros before position 0."""
        assert activation in (None, "silu"), activation
        assert all(t.is_contiguous() for t in (x, weight) + ((bias,) if bias is not None else ()))
        T, C = x.shape
        K = weight.shape[1]
        assert weight.shape == (C, K), (weight.shape, x.shape)
        assert bias is None or bias.shape == (C,)
        self.calls["conv"] += 1
        w = weight.detach().double()
        y = torch.zeros(T, C, dtype=torch.float64)
        for t, seq in enumerate(self._owners(T)):
            past = self.history.setdefault(seq, [])
            past.append(x[t].detach().double())
            p = len(past) - 1
            acc = torch.zeros(C, dtype=torch.float64)
            if bias is not None:
                acc = acc + bias.detach().double()
            for j in range(K):
                src = p - K + 1 + j
                if src >= 0:
                    acc = acc + w[:, j] * past[src]
            y[t] = acc * torch.sigmoid(acc) if activation == "silu" else acc
        return y

    def delta_rule(self, q, k, v, g, beta, *, scale=None, qk_l2norm=False):
        """Per token and head: q, k l2-normalised (`x * rsqrt(sum x^2 + 1e-6)`) when
        `qk_l2norm`; `S <- diag(exp(g)) S`; `S <- S + beta k (v - S^T k)^T` (`beta` None:
        `S <- S + k v^T`); `o = scale * S^T q` (scale `Dk ** -0.5` by default)."""
        given = (q, k, v, g) + ((beta,) if beta is not None else ())
        assert all(t.is_contiguous() and t.dtype == torch.float32 for t in given)
        T, H, Dk = q.shape
        Dv = v.shape[2]
        assert k.shape == (T, H, Dk) and v.shape == (T, H, Dv), (q.shape, k.shape, v.shape)
        assert g.shape in ((T, H), (T, H, Dk)), g.shape
        assert beta is None or beta.shape == (T, H), beta.shape
        self.calls["delta_rule"] += 1
        scale = Dk ** -0.5 if scale is None else scale
        q, k, v, g = (x.detach().double() for x in (q, k, v, g))
        beta = None if beta is None else beta.detach().double()
        o = torch.zeros(T, H, Dv, dtype=torch.float64)
        for t, seq in enumerate(self._owners(T)):
            S = self.states.get(seq)
            if S is None:
                S = torch.zeros(H, Dk, Dv, dtype=torch.float64)
            qt, kt = q[t], k[t]
            if qk_l2norm:
                qt = qt * torch.rsqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
                kt = kt * torch.rsqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
            decay = g[t].exp()
            S = S * (decay[:, None, None] if decay.dim() == 1 else decay[:, :, None])
            if beta is None:
                S = S + kt[:, :, None] * v[t][:, None, :]
            else:
                u = torch.einsum("hkv,hk->hv", S, kt)
                S = S + beta[t][:, None, None] * kt[:, :, None] * (v[t] - u)[:, None, :]
            self.states[seq] = S
            o[t] = scale * torch.einsum("hkv,hk->hv", S, qt)
        return o

    def ssd(self, x, dt, A, B, C, *, D=None, dt_bias=None, dt_limit=(0.0, float("inf"))):
        """Per token and head h (group `h // (H // G)`): `d = clamp(softplus(dt +
        dt_bias), *dt_limit)`; `S_h <- exp(d A_h) S_h + d x_h B_g^T`; `y_h = S_h C_g + D_h
        x_h`, the state `S_h [P, N]`."""
        given = (x, dt, A, B, C) + tuple(t for t in (D, dt_bias) if t is not None)
        assert all(t.is_contiguous() and t.dtype == torch.float32 for t in given)
        T, H, P = x.shape
        G, N = B.shape[1:]
        assert dt.shape == (T, H) and A.shape == (H,) and H % G == 0, (dt.shape, A.shape, G)
        assert B.shape == C.shape == (T, G, N), (B.shape, C.shape)
        assert all(t is None or t.shape == (H,) for t in (D, dt_bias))
        self.calls["ssd"] += 1
        x, dt, A, B, C = (t.detach().double() for t in (x, dt, A, B, C))
        d = dt if dt_bias is None else dt + dt_bias.detach().double()
        d = torch.nn.functional.softplus(d).clamp(*dt_limit)
        group = torch.arange(H) // (H // G)
        y = torch.zeros(T, H, P, dtype=torch.float64)
        for t, seq in enumerate(self._owners(T)):
            S = self.states.get(seq)
            if S is None:
                S = torch.zeros(H, P, N, dtype=torch.float64)
            Bt, Ct = B[t][group], C[t][group]                  # [H, N]
            S = (d[t] * A).exp()[:, None, None] * S \
                + (d[t][:, None] * x[t])[:, :, None] * Bt[:, None, :]
            self.states[seq] = S
            y[t] = torch.einsum("hpn,hn->hp", S, Ct)
            if D is not None:
                y[t] = y[t] + D.detach().double()[:, None] * x[t]
        return y
