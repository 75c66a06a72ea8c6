"""panechat app."""
