"""Serving: the engine loop, scheduler, requests, sampling, events, stats."""
