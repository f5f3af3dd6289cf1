"""Kernels of state layers (hybrid models' mixers): the causal convolution's input ring
(`conv`) and the linear recurrences' states with their input log (`recurrence`), run as
the gated delta rule (`delta_rule`, its prefills in chunks on the tensor cores:
`chunked`, `tiles`) or Mamba2's SSD (`ssd`)."""
