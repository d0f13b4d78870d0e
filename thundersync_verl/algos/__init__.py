"""One folder per algorithm beyond GRPO: OPD (turn teacher), SAO (critic), PACE (sampler, scorer)."""
