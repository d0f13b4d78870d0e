"""PACE: staleness-scored admission for verl's fully-async trainer (sampler and scorer)."""
