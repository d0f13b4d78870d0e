"""Rollout-side pieces that agent loops use (no trainer imports)."""
