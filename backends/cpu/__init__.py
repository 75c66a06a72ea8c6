"""The numpy (CPU) backend and its numba kernels."""
