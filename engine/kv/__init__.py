"""The KV cache: blocks, the prefix cache, snapshots."""
