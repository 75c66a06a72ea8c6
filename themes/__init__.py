"""panechat themes."""
