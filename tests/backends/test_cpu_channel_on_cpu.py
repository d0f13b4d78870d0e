"""Checkpoint engine ``cpu_channel`` over a real Ray mailbox: a push cut half-way is refused whole. CPU only.

``push_fail@step=S`` ($THUNDERSYNC_FAULTS) makes the learner send half of version S's tensors, then
raise, as a sender that dies mid-push does. The receiver must load nothing of it (a rollout on a mix of
two versions would generate from weights no learner ever had): it keeps waiting, and the whole version
pushed again must reach it intact; a partial snapshot still there at the wait's end is refused.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from thundersync_verl.run import faults
from thundersync_verl.backends.cpu.cpu_channel import IncompletePushError, channel_handle, make_engine_class

pytestmark = pytest.mark.slow  # starts a Ray cluster (~10 s)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from thundersync_harness import engine_setup as setup

    with setup.ray_session() as ray_tmp:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(ray_tmp))
        yield


def _engines():
    cls = make_engine_class()
    sender, receiver = cls(), cls()
    sender.init_process_group(rank=0, is_sender=True)
    receiver.init_process_group(rank=0, is_sender=False)
    return sender, receiver


async def _receive(receiver, version) -> dict:
    return {name: t async for name, t in receiver.receive_weights(version)}


def test_a_push_cut_half_way_is_never_loaded_and_the_repeated_push_completes_the_waiting_receiver(
        ray_cluster, monkeypatch, tmp_path):
    import ray

    monkeypatch.setenv(faults.LOG_ENV, str(tmp_path / "faults.jsonl"))
    faults.reload("push_fail@step=3")
    try:
        sender, receiver = _engines()
        weights = {f"layer{i}.weight": torch.randn(8, 4) for i in range(6)}
        asyncio.run(sender.send_weights(iter(weights.items()), global_steps=2))  # not the named version
        assert sorted(asyncio.run(_receive(receiver, 2))) == sorted(weights)
        new = {k: v + 1.0 for k, v in weights.items()}
        with pytest.raises(RuntimeError, match="failed after 3 of 6 tensors"):
            asyncio.run(sender.send_weights(iter(new.items()), global_steps=3))
        with pytest.raises(Exception, match="holds 3 of 6 tensors") as err:  # only the partial snapshot: refused
            ray.get(channel_handle().get.remote(3, 1.0))
        assert "IncompletePushError" in repr(err.value) or isinstance(err.value, IncompletePushError)

        async def repeat_while_a_receiver_waits():
            waiting = asyncio.ensure_future(_receive(receiver, 3))  # sees the partial snapshot, keeps waiting
            await asyncio.sleep(0.5)
            assert not waiting.done()
            await sender.send_weights(iter(new.items()), global_steps=3)  # the trainer's retry: the whole version
            return await asyncio.wait_for(waiting, 30)

        got = asyncio.run(repeat_while_a_receiver_waits())
        assert sorted(got) == sorted(new) and all(torch.equal(got[k], new[k]) for k in new)
        assert [f["fault"] for f in faults.read_log(tmp_path / "faults.jsonl")] == ["push_fail"]
    finally:
        faults.reload("")


def test_the_mailbox_is_the_jobs_own_and_every_actor_of_the_job_finds_it(ray_cluster):
    """``backends/mailbox.py``: the name carries the job's id (two jobs in one namespace never share a mailbox), and an
    actor the job starts (a rollout server) reaches the driver's mailbox by it."""
    import ray

    from thundersync_verl.backends.cpu.cpu_channel import CHANNEL_NAME
    from thundersync_verl.backends.mailbox import job_scoped

    job = ray.get_runtime_context().get_job_id()
    assert job_scoped(CHANNEL_NAME) == f"{CHANNEL_NAME}@{job}"
    ray.get(channel_handle().put.remote("v-mailbox", [ray.put([("w", torch.ones(2))])], 1))

    @ray.remote(num_cpus=0)
    def from_an_actor_of_the_job():
        box = ray.get(channel_handle().get.remote("v-mailbox", 5.0))
        return ray.get_runtime_context().get_job_id(), ray.get(box[0])[0][0]

    assert ray.get(from_an_actor_of_the_job.remote()) == (job, "w")

    @ray.remote(num_cpus=0)
    def manager_process():  # verl's manager computes the topology before every push, and holds the mailbox
        from thundersync_verl.backends import mailbox

        make_engine_class().build_topology(1, 1, [{}, {}])
        return job_scoped(CHANNEL_NAME) in mailbox._claimed

    assert ray.get(manager_process.remote())
    assert ray.get_actor(job_scoped(CHANNEL_NAME)) is not None
    with pytest.raises(ValueError):
        ray.get_actor(CHANNEL_NAME)  # no unscoped mailbox a second job could share
