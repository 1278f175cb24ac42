"""The host."""
