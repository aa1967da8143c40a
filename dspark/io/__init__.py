"""Crash-safe file writes and strict JSON."""
