"""How kernels are launched: the shared constants (`constants`), the calling convention
(`calling`), Numba's kernel ABI (`abi`) and launches straight through the CUDA driver
(`lean`)."""
