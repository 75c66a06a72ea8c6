"""Tests of backends/ (the test tree mirrors the code tree)."""
