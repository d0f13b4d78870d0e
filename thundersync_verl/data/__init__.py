"""Data builders for verl's parquet format beyond the embedded task.

1. ``swe_smith``: SWE-smith instances (the user's copy; nothing is downloaded) to verl rows for the
   SWE agent loop (``envs/swe``).
2. ``swe_synthetic``: a SWE-smith-format set of tiny repositories with planted bugs, built and
   validated here, so the whole SWE path runs on a CPU machine; ``synthetic_catalog`` holds them.
"""
