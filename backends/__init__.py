"""panechat backends."""
