"""Screens and dialogs, one per file."""
