"""verl_adapter.patches.fsdp2_offload_unpinned: verl's forward-only FSDP2 engines (the KL reference model) start on the CPU.

verl builds them with ``CPUOffloadPolicy(pin_memory=True)``; pinning needs an accelerator. The patched
policy is torch's own with ``pin_memory=False``, and FSDP2 under it computes what the plain module does.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

FSDP2_FORWARD = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from thundersync_verl.verl_adapter.patches import patch_fsdp2_offload_unpinned
    patch_fsdp2_offload_unpinned()
    from verl.workers.engine.fsdp import transformer_impl
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = model(x).clone()
    policy = transformer_impl.CPUOffloadPolicy(pin_memory=True)  # what verl asks for a forward-only engine
    for layer in model:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    with torch.no_grad():
        got = model(x)
    print("MAXDIFF", float((got - want).abs().max()))
    dist.destroy_process_group()
""")


def test_the_patched_policy_is_torchs_without_pinning():
    from torch.distributed.fsdp import CPUOffloadPolicy

    from thundersync_verl.verl_adapter.patches import APPLIED, patch_fsdp2_offload_unpinned

    patch_fsdp2_offload_unpinned()
    from verl.workers.engine.fsdp import transformer_impl

    policy = transformer_impl.CPUOffloadPolicy(pin_memory=True)
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False
    assert "fsdp2_offload_unpinned" in APPLIED
    wrapped = transformer_impl.CPUOffloadPolicy
    patch_fsdp2_offload_unpinned()  # applying twice wraps once
    assert transformer_impl.CPUOffloadPolicy is wrapped
    assert type(transformer_impl.CPUOffloadPolicy(pin_memory=True)) is CPUOffloadPolicy


def test_fsdp2_with_verls_forward_only_policy_runs_and_matches_the_plain_module():
    import random

    port = str(random.Random().randrange(20000, 40000))
    out = subprocess.run([sys.executable, "-c", "import sys\n" + FSDP2_FORWARD, port], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    diff = float(out.stdout.split("MAXDIFF")[-1])
    assert diff == 0.0
