"""Widgets: panes, the pane grid, the prompt input, the transcript, the dashboard."""
