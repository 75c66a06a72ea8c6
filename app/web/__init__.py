"""`panechat web`: the TUI in a browser, through textual-serve."""
