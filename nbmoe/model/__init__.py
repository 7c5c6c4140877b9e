"""The model: architectures as data, the op graph of a forward pass, the float64 reference, the KV cache."""
