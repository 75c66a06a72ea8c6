"""Tests of engine/ (the test tree mirrors the code tree)."""
