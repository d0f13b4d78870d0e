"""The embedded agentic task: arithmetic with a sandboxed python tool.

1. ``protocol`` defines the text conventions shared by data, agent loop and reward.
2. ``sandbox`` runs model-written code in an isolated, limited, network-less subprocess, inside the
   kernel sandbox of ``jail`` (namespaces, read-only root, unprivileged uid; ``jail_host`` holds what a
   workspace keeps on the host); ``tool`` wraps it with transient failures and modelled latency.
3. ``verifier`` and ``reward`` score trajectories for verl; ``latency`` shapes their delays;
   ``dataset`` writes verl's parquet format.
Nothing here imports ray or verl at module level.
"""
