"""Deterministic replay: record what a rollout produced (``record``), serve it back (rollout ``replay``, ``reward``).

``record.py`` documents the JSONL format and how to record; ``server.py`` is the rollout backend;
``reward.py`` the replay reward function; ``recording.py`` loads and indexes a recording.
"""
