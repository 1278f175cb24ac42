"""Base models."""
