"""GGUF files in: the zero-copy reader, load-time repacking, upcycling, the default model."""
