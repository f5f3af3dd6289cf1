"""Inline-PTX intrinsics and their simulator twins: how one is emitted (`ptxgen`), element
intrinsics (`ptx`), the tensor-core path's (`tensorcore`), 8-bit float conversions (`fp8`),
16-byte words widened (`words`), and the simulator's side (`ptxsim`, `fp8sim`, `simwarp`, `simpace`)."""
