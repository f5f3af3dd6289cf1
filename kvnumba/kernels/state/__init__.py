"""Kernels of state layers (hybrid models' mixers): the causal convolution's input ring
(`conv`) and the gated delta rule's recurrent state with its input log (`delta_rule`)."""
