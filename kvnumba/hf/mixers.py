"""The state mixers of hybrid `transformers` models computed over a packed step.

A hybrid model's linear layers keep a per-sequence state instead of K/V: the window of a
depthwise causal convolution and, for the delta-rule and Mamba mixers, a recurrent
matrix per head: `[heads, k_dim, v_dim]` for the delta rule, `[heads, head_dim,
state_size]` for Mamba2's selective scan (the cache's SSD), and for Mamba1 (Mamba,
Falcon-Mamba, Jamba) the decay-only delta rule with a decay per key channel on one head
per inner channel, `[d_inner, state_size, 1]`. `transformers`' own mixers keep that
state per batch row and cannot run packed or padded rows exactly; kvnumba runs them
itself. Each function here takes a mixer module, the step's `hidden [T, hidden]` (many
sequences' tokens on one axis) and `ops`, the state layer's operations (given contiguous
tensors):

- `ops.conv(x [T, C], weight [C, K], bias [C] or None, activation=None | "silu") -> y`:
  the depthwise causal convolution of each token over its own sequence's inputs;
- `ops.delta_rule(q, k [T, H, Dk], v [T, H, Dv], g [T, H] or [T, H, Dk], beta [T, H] or
  None, *, scale=None, qk_l2norm=False) -> o [T, H, Dv]`: the gated delta rule from
  each sequence's state (log-decay `g`; `scale` defaults to `Dk ** -0.5`);
- `ops.ssd(x [T, H, P], dt [T, H], A [H], B, C [T, G, N], *, D=None, dt_bias=None,
  dt_limit=(0, inf)) -> y [T, H, P]`: Mamba2's selective scan from each sequence's state
  `S_h [P, N]` (`d = clamp(softplus(dt + dt_bias), *dt_limit)`; `S_h <- exp(d A_h) S_h +
  d x_h B_g^T`; `y_h = S_h C_g + D_h x_h`; head h reads group `h // (H // G)`).

Everything else (projections, gates, norms, the output projection) is the module's own
submodules, called as its `forward` calls them, so a mixer computes what `transformers`
computes for one sequence. `MIXERS` maps each mixer class name to its function and the
state it keeps (`state_shape`); `forward` dispatches on the module's class.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

from ..errors import ConfigError

#: the conv activations `ops.conv` computes, by the names models give them
_ACTIVATIONS = {None: None, "silu": "silu", "swish": "silu"}


class Mixer(NamedTuple):
    """A mixer class's `forward(module, hidden, ops) -> out` and its `state(module) ->
    (conv, recurrent)`: `conv=(channels, width)` of its convolution window and
    `recurrent` the shape of its recurrent state (`(heads, k_dim, v_dim)` for the delta
    rule, `(heads, head_dim, state_size)` for the SSD), each None if it keeps none."""

    forward: Callable
    state: Callable


def forward(module, hidden, ops):
    """`out [T, hidden]`: mixer `module`'s output for the packed step's `hidden [T,
    hidden]`, its convolution and recurrence run by `ops` (a `ConfigError` naming the
    class if kvnumba does not compute it). `hidden [1, T, hidden]`, as a decoder layer
    hands its mixer the packed row, gives `out [1, T, hidden]`."""
    run = mixer(module).forward
    if hidden.dim() == 3:
        if hidden.shape[0] != 1:
            raise ConfigError(f"{type(module).__name__}: hidden states of {hidden.shape[0]} "
                              f"rows; a packed step is one row [1, T, hidden]")
        return run(module, hidden[0], ops)[None]
    return run(module, hidden, ops)


def mixer_layers(model) -> dict:
    """`{layer index: mixer module}` of every module of `model` that `MIXERS` computes,
    by the module's `layer_idx`."""
    return {m.layer_idx: m for m in model.modules() if type(m).__name__ in MIXERS}


def state_shape(module):
    """`(conv, recurrent)` the cache keeps per sequence for mixer `module`: `conv =
    (channels, width)` or None, `recurrent` the recurrent state's shape (`Mixer`) or
    None."""
    return mixer(module).state(module)


def mixer(module) -> Mixer:
    """`MIXERS`' entry for `module`'s class, or `ConfigError` naming it."""
    name = type(module).__name__
    if name not in MIXERS:
        raise ConfigError(f"{name}: a mixer kvnumba does not compute (it computes "
                          f"{', '.join(sorted(MIXERS))})")
    return MIXERS[name]


def _conv(module, conv, x, ops, activation):
    """The module's depthwise causal `conv` over `x [T, C]` through `ops.conv`, in
    `x`'s dtype (as `transformers` returns it)."""
    if activation not in _ACTIVATIONS:
        raise ConfigError(f"{type(module).__name__}: its convolution's activation "
                          f"{activation!r} is not computed (None or 'silu')")
    weight = conv.weight.detach().squeeze(1)
    bias = None if conv.bias is None else conv.bias.detach()
    y = ops.conv(x.contiguous(), weight, bias, activation=_ACTIVATIONS[activation])
    return y.to(x.dtype)


def _f32(*xs):
    """`xs` as contiguous float32 tensors (what the recurrent ops compute in)."""
    return [x.float().contiguous() for x in xs]


def _grouped(x, heads: int):
    """`x [T, Hk, D]` repeated to `heads` heads, each key head serving consecutive value
    heads (as `transformers` repeats them)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


# ----- gated delta rule (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-hybrid) -----

def _gdn_state(module):
    return ((module.conv_dim, module.conv_kernel_size),
            (module.num_v_heads, module.head_k_dim, module.head_v_dim))


def _gdn_core(module, mixed_qkv, a, b, ops, *, beta_scale=1.0):
    """The conv over `mixed_qkv [T, 2*Hk*dk + Hv*dv]` and the delta rule, as GDN mixers
    compute them: conv with the module's activation (SiLU), q and k repeated to the value
    heads, `beta = sigmoid(b)` (times `beta_scale`), `g = -exp(A_log) * softplus(a +
    dt_bias)`, q and k l2-normalised (eps 1e-6) in float32; `o [T, Hv, dv]` in the
    model's dtype."""
    import torch.nn.functional as F
    T = mixed_qkv.shape[0]
    mixed_qkv = _conv(module, module.conv1d, mixed_qkv, ops, module.activation)
    q, k, v = mixed_qkv.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    heads = module.num_v_heads
    q = _grouped(q.reshape(T, -1, module.head_k_dim), heads)
    k = _grouped(k.reshape(T, -1, module.head_k_dim), heads)
    v = v.reshape(T, heads, module.head_v_dim)
    beta = b.sigmoid()
    if beta_scale != 1.0:
        beta = beta * beta_scale
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    o = ops.delta_rule(*_f32(q, k, v, g, beta), qk_l2norm=True)
    return o.to(v.dtype)


def _gated_out(norm, out_proj, o, gate):
    """`out_proj(norm(o, gate))` per head: the module's gated RMS norm over `o [T, H,
    dv]` with `gate` reshaped to it."""
    T, H, dv = o.shape
    y = norm(o.reshape(-1, dv), gate.reshape(-1, dv))
    return out_proj(y.reshape(T, H * dv))


def qwen3_next(module, hidden, ops):
    """`Qwen3NextGatedDeltaNet`: q, k, v and the gate z from the fused `in_proj_qkvz`,
    b and a from `in_proj_ba`, both laid out per key-head group (the module's own
    `fix_query_key_value_ordering` splits them); norm then SiLU gate
    (`Qwen3NextRMSNormGated`, eps `rms_norm_eps`), `out_proj`."""
    T = hidden.shape[0]
    q, k, v, z, b, a = module.fix_query_key_value_ordering(
        module.in_proj_qkvz(hidden)[None], module.in_proj_ba(hidden)[None])
    mixed = _cat([x.reshape(T, -1) for x in (q, k, v)])
    o = _gdn_core(module, mixed, a[0], b[0], ops)
    return _gated_out(module.norm, module.out_proj, o, z[0])


def qwen3_5(module, hidden, ops):
    """`Qwen3_5GatedDeltaNet` / `Qwen3_5MoeGatedDeltaNet`: `in_proj_qkv` (q, k, v laid
    out whole), `in_proj_z`, `in_proj_b`, `in_proj_a`; norm then SiLU gate, `out_proj`."""
    o = _gdn_core(module, module.in_proj_qkv(hidden), module.in_proj_a(hidden),
                  module.in_proj_b(hidden), ops)
    return _gated_out(module.norm, module.out_proj, o, module.in_proj_z(hidden))


def olmo_hybrid(module, hidden, ops):
    """`OlmoHybridGatedDeltaNet`: separate `q_proj`, `k_proj`, `v_proj`, `a_proj`,
    `b_proj`; one conv over q, k, v (the checkpoint's three, concatenated at load);
    `beta` doubled when `linear_allow_neg_eigval` (beta in (0, 2)); gate `g_proj`, norm
    then SiLU gate (`o_norm`, eps 1e-5 whatever `rms_norm_eps` says), `o_proj`."""
    mixed = _cat([module.q_proj(hidden), module.k_proj(hidden), module.v_proj(hidden)])
    o = _gdn_core(module, mixed, module.a_proj(hidden), module.b_proj(hidden), ops,
                  beta_scale=2.0 if module.allow_neg_eigval else 1.0)
    return _gated_out(module.o_norm, module.o_proj, o, module.g_proj(hidden))


# ----- delta rule with a per-channel decay (Kimi-Linear, Bailing-hybrid) -----

def _kda_state(module):
    return ((module.conv_dim, module.conv_kernel_size),
            (module.num_heads, module.head_dim, module.head_dim))


def _kda_l2norm(x):
    """`x / sqrt(sum(x**2) + 1e-6)` in float32, as Kimi's reference divides (the op's
    `qk_l2norm` multiplies by the rsqrt instead)."""
    return x / ((x * x).sum(dim=-1, keepdim=True) + 1e-6).sqrt()


def _kda_core(module, hidden, ops):
    """The conv over `q_proj, k_proj, v_proj` (one depthwise conv over their
    concatenation, into which `transformers` loads the checkpoint's `q_conv1d`,
    `k_conv1d`, `v_conv1d`; the module's activation) and the delta rule with the module's
    `forget_gate` (a log-decay per key channel `[T, H, d]`) and `beta =
    sigmoid(b_proj)`; q and k l2-normalised here; `o [T, H, d]` in the model's dtype."""
    T, H, d = hidden.shape[0], module.num_heads, module.head_dim
    mixed = _cat([module.q_proj(hidden), module.k_proj(hidden), module.v_proj(hidden)])
    mixed = _conv(module, module.conv1d, mixed, ops, module.activation)
    q, k, v = (x.reshape(T, H, d) for x in mixed.split([module.qkv_dim] * 3, dim=-1))
    g = module.forget_gate(hidden[None])[0]
    beta = module.b_proj(hidden).sigmoid()
    o = ops.delta_rule(*_f32(_kda_l2norm(q.float()), _kda_l2norm(k.float()), v, g, beta),
                       qk_l2norm=False)
    return o.to(v.dtype)


def kimi_linear(module, hidden, ops):
    """`KimiLinearDeltaAttention`: decay `-exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`
    per key channel (its `forget_gate`), output gate `g_b_proj(g_a_proj(x))`; norm then
    SIGMOID gate (`KimiLinearRMSNormGated`, float32 weight), `o_proj`."""
    o = _kda_core(module, hidden, ops)
    gate = module.g_b_proj(module.g_a_proj(hidden))
    return _gated_out(module.o_norm, module.o_proj, o, gate)


def bailing_hybrid(module, hidden, ops):
    """`BailingHybridDeltaAttention`: decay per key channel from its `forget_gate`
    (`f_proj`; with `kda_safe_gate` `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`,
    else `-exp(A_log) * softplus(f + dt_bias)`; rounded to the model's dtype), output
    gate `g_proj(x)`; norm then SIGMOID gate, `o_proj`."""
    o = _kda_core(module, hidden, ops)
    return _gated_out(module.o_norm, module.o_proj, o, module.g_proj(hidden))


# ----- short gated convolution (LFM2, LFM2-MoE, LFM3) -----

def _short_conv_state(module):
    return (module.conv.in_channels, module.conv_kernel_size), None


def short_conv(module, hidden, ops):
    """`Lfm2ShortConv` / `Lfm2MoeShortConv` / `Lfm3ShortConv`: `B, C, x = in_proj(h)`,
    `out_proj(C * conv(B * x))`; the conv has no activation, a bias when `conv_bias`
    (which also biases `in_proj` and `out_proj`), width `conv_L_cache` (3 in LFM2, 7 by
    default in LFM3)."""
    B, C, x = module.in_proj(hidden).chunk(3, dim=-1)
    y = _conv(module, module.conv, B * x, ops, None)
    return module.out_proj(C * y)


# ----- Mamba2 SSD (Granite-4.0-H, Nemotron-H, Bamba, Zamba2, Falcon-H1, Mamba-2) -----

def _mamba2_state(module):
    """The conv window over `xBC` and the SSD state `[H, P, N]` (Mamba2's `S_h [P, N]`)."""
    return ((module.conv_dim, module.conv_kernel_size),
            (module.num_heads, module.head_dim, module.ssm_state_size))


def _mamba2_scan(module, projected, ops):
    """`(y [T, d_inner] float32, gate z)` from `projected = in_proj(h)`, laid out `[z,
    xBC, dt]`: the conv over `xBC` (with its bias, the module's activation), then the
    selective scan `ops.ssd` (`A = -exp(A_log)`, the module's `D` and `dt_bias`, each
    group of B and C serving consecutive heads), in float32.

    `d = softplus(dt + dt_bias)` is clamped to `time_step_limit` as `transformers`'
    prefill (its chunked scan, as on one sequence with no cache) clamps it. Its decode
    step (one token on a cached state) does not clamp; where the limit binds (never at
    the default `(0, inf)`; Zamba2's is `(time_step_min, inf)`) a token's output here is
    its prefill output wherever the step cuts the sequence, and may differ from
    `transformers`' decode."""
    T, H, P = projected.shape[0], module.num_heads, module.head_dim
    G, N = module.n_groups, module.ssm_state_size
    gate, xBC, dt = projected.split([module.intermediate_size, module.conv_dim, H], dim=-1)
    xBC = _conv(module, module.conv1d, xBC, ops, module.activation)
    x, B, C = xBC.split([module.intermediate_size, G * N, G * N], dim=-1)
    limit = module.time_step_limit
    A, D, dt_bias = (p.detach() for p in (module.A_log, module.D, module.dt_bias))
    y = ops.ssd(*_f32(x.reshape(T, H, P), dt, -A.float().exp(), B.reshape(T, G, N),
                      C.reshape(T, G, N)), D=D.float(), dt_bias=dt_bias.float(),
                dt_limit=(0.0, math.inf) if limit is None else tuple(limit))
    return y.reshape(T, H * P), gate


def mamba2(module, hidden, ops):
    """`GraniteMoeHybridMambaLayer`, `NemotronHMamba2Mixer`, `BambaMixer`,
    `Zamba2MambaMixer`, `Mamba2Mixer`: `in_proj`, the scan, SiLU gate then grouped RMS norm (the
    module's `norm(y, z)`: `w * rmsnorm_G(y * silu(z))`, in float32), `out_proj` in the
    model's dtype."""
    y, gate = _mamba2_scan(module, module.in_proj(hidden), ops)
    return module.out_proj(module.norm(y, gate).to(hidden.dtype))


def falcon_h1(module, hidden, ops):
    """`FalconH1Mixer` (the SSM half of a Falcon-H1 layer): `in_proj(h *
    ssm_in_multiplier) * mup_vector` (its per-part multipliers of z, x, B, C, dt), the
    scan, then with `mamba_rms_norm` the module's `norm(y, z)` (grouped; norm then SiLU
    gate when `mamba_norm_before_gate`, else gate then norm), without it `y * silu(z)`;
    `out_proj`. The decoder layer scales the result by `ssm_out_multiplier` itself."""
    import torch.nn.functional as F
    projected = module.in_proj(hidden * module.ssm_in_multiplier)
    projected = projected * module.mup_vector.reshape(-1)
    y, gate = _mamba2_scan(module, projected, ops)
    y = module.norm(y, gate) if module.mamba_rms_norm else y * F.silu(gate)
    return module.out_proj(y.to(hidden.dtype))


# ----- Mamba1 selective scan (Mamba, Falcon-Mamba, Jamba) -----
# Mamba1's A is a row of N per inner channel, which the SSD (one scalar A per head) cannot
# express: its scan runs as the decay-only delta rule with a decay per key channel.

def _mamba1_state(module):
    """The conv window over x and the state `[d_inner, N, 1]`: Mamba1's `h [d_inner, N]`
    as `d_inner` delta-rule heads of `Dk = N`, `Dv = 1`."""
    return ((module.intermediate_size, module.conv_kernel_size),
            (module.intermediate_size, module.ssm_state_size, 1))


def mamba(module, hidden, ops, *, normed=False):
    """`MambaMixer`: `x, z = in_proj(h)`, the conv over x (with its bias, the module's
    activation), `dt, B, C = x_proj(x)` (each through its RMS norm when `normed`:
    `dt_layernorm`, `b_layernorm`, `c_layernorm`), `d = softplus(dt_proj(dt))` per
    channel; the selective scan `h_c <- exp(d_c A_c) h_c + d_c x_c B`, `y_c = C . h_c +
    D_c x_c` (`A = -exp(A_log)`, one row of N per channel) as the decay-only delta rule
    with a per-key-channel decay on `d_inner` heads of `Dk = N`, `Dv = 1` (`q = C`, `k =
    B` on every head, `v = d x`, `g = d A`, scale 1); SiLU gate, `out_proj`."""
    import torch.nn.functional as F
    T, D, N = hidden.shape[0], module.intermediate_size, module.ssm_state_size
    x, gate = module.in_proj(hidden).chunk(2, dim=-1)
    x = _conv(module, module.conv1d, x, ops, module.activation)
    dt, B, C = module.x_proj(x).split([module.time_step_rank, N, N], dim=-1)
    if normed:
        dt, B, C = module.dt_layernorm(dt), module.b_layernorm(B), module.c_layernorm(C)
    d = F.softplus(module.dt_proj(dt)).float()
    x = x.float()
    g = d[..., None] * -module.A_log.float().exp()
    o = ops.delta_rule(*_f32(C[:, None].expand(T, D, N), B[:, None].expand(T, D, N),
                             (d * x)[..., None], g), None, scale=1.0, qk_l2norm=False)
    y = (o[..., 0] + module.D.float() * x) * F.silu(gate.float())
    return module.out_proj(y.to(hidden.dtype))


def jamba(module, hidden, ops):
    """`JambaMambaMixer`, `FalconMambaMixer`: `mamba` with dt, B and C through their RMS
    norms."""
    return mamba(module, hidden, ops, normed=True)


def _cat(parts):
    """`parts` joined along their last dimension."""
    import torch
    return torch.cat(parts, dim=-1)


_GDN = Mixer(qwen3_5, _gdn_state)
_MAMBA2 = Mixer(mamba2, _mamba2_state)
#: mixer class name -> its `Mixer` (forward and state shape)
MIXERS = {
    "Qwen3NextGatedDeltaNet": Mixer(qwen3_next, _gdn_state),
    "Qwen3_5GatedDeltaNet": _GDN,
    "Qwen3_5MoeGatedDeltaNet": _GDN,
    "OlmoHybridGatedDeltaNet": Mixer(olmo_hybrid, _gdn_state),
    "KimiLinearDeltaAttention": Mixer(kimi_linear, _kda_state),
    "BailingHybridDeltaAttention": Mixer(bailing_hybrid, _kda_state),
    "Lfm2ShortConv": Mixer(short_conv, _short_conv_state),
    "Lfm2MoeShortConv": Mixer(short_conv, _short_conv_state),
    "Lfm3ShortConv": Mixer(short_conv, _short_conv_state),
    "GraniteMoeHybridMambaLayer": _MAMBA2,
    "NemotronHMamba2Mixer": _MAMBA2,
    "BambaMixer": _MAMBA2,
    "Zamba2MambaMixer": _MAMBA2,
    "FalconH1Mixer": Mixer(falcon_h1, _mamba2_state),
    "Mamba2Mixer": _MAMBA2,
    "JambaMambaMixer": Mixer(jamba, _mamba1_state),
    "FalconMambaMixer": Mixer(jamba, _mamba1_state),
    "MambaMixer": Mixer(mamba, _mamba1_state),
}
