"""SparseRL-Sync: lossless sparse learner -> rollout weight pushes (verl checkpoint engine ``sparse_sync``).

1. ``codec``: bitwise diff (integer views, word-wide, chunked), per-dtype buckets of (int32 index,
   value bits), the push checksum.
2. ``state``: the sender's per-shard snapshot in the rollout dtype and the receiver's copy, with the
   chain of push tokens that decides when a full push is needed.
3. ``wire``: the rendezvous actor (offers, acks, decisions) and the bucket transports (Ray's object
   store; NCCL broadcast, unverified).
4. ``checkpoint_engine``: the verl backend that puts these together, registered as ``sparse_sync``.
"""
