"""Fault injection for tests and drills."""
