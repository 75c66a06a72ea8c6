"""The model: its arguments, the one forward pass, loading, the start-up invariance check."""
