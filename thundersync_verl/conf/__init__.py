"""Hydra configs shipped with the package: ``pkg://thundersync_verl.conf`` on a recipe's search path.

Why:
1. Every recipe, CPU and GPU, composes the ``thundersync:`` section from one file,
   ``thundersync/defaults.yaml`` (``defaults: [..., {thundersync: defaults}, ...]``), so each key
   exists once and ``thundersync.<key>=<value>`` overrides work in every recipe without ``+``.
2. The file lists each field of ``thundersync_verl.config.ThunderSyncConfig`` at its default; a test
   compares the two, so the recipes can never drift from the typed config.
"""
