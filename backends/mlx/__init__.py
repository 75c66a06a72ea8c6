"""The MLX backend (Apple silicon; mlx[cpu] elsewhere)."""
