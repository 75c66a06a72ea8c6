"""GGUF weight types: the quant-type registry and a tensor as the file stores it."""
