"""The CPU and CUDA backends: bind each graph node to a kernel call."""
