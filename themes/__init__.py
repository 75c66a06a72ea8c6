"""panechat's Textual themes: registered with the App, chosen from the command palette.

The chosen name is saved in the store's settings, so it comes back on the next start.
"""

from __future__ import annotations

from textual.theme import Theme

PANECHAT_DARK = Theme(
    name="panechat-dark",
    primary="#5FA8D3",
    secondary="#9D7CD8",
    accent="#F0A04B",
    warning="#E0AF68",
    error="#F7768E",
    success="#9ECE6A",
    foreground="#D4D8E0",
    background="#14171C",
    surface="#1B1F26",
    panel="#232933",
    dark=True,
    variables={"footer-key-foreground": "#F0A04B", "block-cursor-text-style": "none"},
)

PANECHAT_LIGHT = Theme(
    name="panechat-light",
    primary="#1F6FB2",
    secondary="#7A4FB8",
    accent="#B85C00",
    warning="#9A6700",
    error="#C62F3F",
    success="#2E7D32",
    foreground="#1F2328",
    background="#F6F7F9",
    surface="#FFFFFF",
    panel="#E7EAEF",
    dark=False,
    variables={"footer-key-foreground": "#B85C00"},
)

PANECHAT_EMBER = Theme(
    name="panechat-ember",
    primary="#E07A5F",
    secondary="#81B29A",
    accent="#F2CC8F",
    warning="#F2CC8F",
    error="#E63946",
    success="#81B29A",
    foreground="#EDE6DB",
    background="#1E1A17",
    surface="#27221E",
    panel="#332C26",
    dark=True,
    variables={"footer-key-foreground": "#F2CC8F"},
)

THEMES: list[Theme] = [PANECHAT_DARK, PANECHAT_LIGHT, PANECHAT_EMBER]
DEFAULT_THEME = PANECHAT_DARK.name

__all__ = ["THEMES", "DEFAULT_THEME", "PANECHAT_DARK", "PANECHAT_LIGHT", "PANECHAT_EMBER"]
