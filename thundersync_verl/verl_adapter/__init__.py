"""The one place that reaches into verl internals.

1. Everything thundersync_verl needs from verl beyond its documented config is
   imported here, so a verl upgrade touches this package (and ``tests/test_verl_api_on_cpu.py``
   imports every symbol it reaches against the pinned version).
2. Imports are lazy: ``thundersync_verl.core`` and the simulator never import verl,
   and importing this package is cheap.
3. Callers use one namespace (``from thundersync_verl import verl_adapter as va``); the reaches live in
   three modules by who needs them: ``plugins`` (verl's registries and base classes), ``learner`` (the
   streaming worker's engine and data reaches) and ``trainer`` (the V1 trainer, OPD, SAO, the recipe check,
   the streamed critic).
4. Beside them, what changes verl's behaviour lives here too, each in one module: ``patches`` (every
   runtime patch, listed in ``patches/README.md``), ``patch_hooks`` (where patches hook in),
   ``registrations`` (registrations that need heavier verl modules) and ``launch_check`` (the plugin's
   config rules on verl's driver, before ``ray.init``, with ``bucket_check``: the learner's planned bucket
   memory). They are not re-exported through ``va``.
"""

from __future__ import annotations

from thundersync_verl.verl_adapter.learner import *  # noqa: F401,F403
from thundersync_verl.verl_adapter.plugins import *  # noqa: F401,F403
from thundersync_verl.verl_adapter.trainer import *  # noqa: F401,F403

VERL_VERSION = "0.9.1"
MODULES = ("plugins", "learner", "trainer")  # the reach modules, re-exported as va (tests read each one's source)
BEHAVIOUR_MODULES = ("patches", "patch_hooks", "registrations", "launch_check", "bucket_check")  # point 4
