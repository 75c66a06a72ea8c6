"""The terminal UI: conversation panes over a ChatBackend, and the batch dashboard."""
