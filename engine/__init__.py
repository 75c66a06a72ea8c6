"""panechat engine."""
