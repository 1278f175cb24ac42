"""The torch engine."""
