"""``thundersync_harness``: the reference code that tests and benchmarks share, outside the package.

Why:
1. The exactness checks need reference implementations (verl's batch-synchronous update on a
   tiny transformer, an in-process HF teacher, a blocking learner client, the engine setup).
   They are not part of a training run, so they do not ship inside ``thundersync_verl``.
2. Tests and benchmarks import the SAME code, so the figures a benchmark prints come from what
   the tests check. ``setup.py`` registers this folder as the package ``thundersync_harness``;
   the editable install (``pip install -e .``, what ``make install`` runs) makes
   ``import thundersync_harness`` work from ``pytest`` and from ``python benchmarks/<x>.py``
   alike, with no path edits.
3. Modules: ``tiny_lm`` (tiny Qwen2, verl's synchronous oracle, the streamed accumulator flow),
   ``teacher`` (HF teacher scorer with KV-cache sessions and retries), ``engine_setup`` and
   ``engine_steps`` (verl's FSDP2 engine on the CPU: setup, the synchronous and streamed step), ``batching``
   (verl's packed rows and token-budgeted micro-batches for the equivalence comparison), ``lora`` (a peft adapter
   on verl's engine, its adapter-off KL reference and the rollout's measured staleness),
   ``verl_reach`` (every verl name the package relies on, derived from its source, for the API test).
   Heavy imports (transformers, ray, verl workers) happen inside the functions that need them.
"""
