"""The CuPy (CUDA) backend: kernels, packed weights, graphs, the tensor-core mode."""
