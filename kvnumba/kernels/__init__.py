"""Numba CUDA kernels: one `@cuda.jit` per job; host wrappers choose launch shapes.

Kernels know storage layouts and the segment table, nothing about slots or states.
"""
