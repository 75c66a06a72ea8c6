"""Reading GGUF files: the header, the metadata, tensors as views of the memory map."""
