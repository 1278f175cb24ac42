"""Rollouts."""
