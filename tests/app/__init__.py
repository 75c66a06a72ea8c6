"""Tests of app/ (the test tree mirrors the code tree)."""
