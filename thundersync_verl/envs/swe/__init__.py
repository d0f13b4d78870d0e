"""The SWE task: a ReAct agent loop over a per-trajectory repository, scored by the instance's tests.

1. ``instance`` reads SWE-smith rows (what ``patch`` means is documented there); ``protocol`` holds the
   prompt and the tool-call syntax; ``config`` types the run config's ``swe`` section.
2. ``sandbox`` defines the workspace interface and the ``local`` backend (the kernel sandbox on a
   repository copy); ``docker`` the container backend; ``swe.sandbox`` picks one; ``escapes`` is the
   escape suite both are checked with.
3. ``tools`` runs bash / view_file / edit_file / submit; ``verifier`` runs FAIL_TO_PASS / PASS_TO_PASS;
   ``agent_loop`` is the registered verl agent loop that ties them together.
Nothing here imports ray or verl at module level except ``agent_loop`` (verl's agent-loop base).
"""
