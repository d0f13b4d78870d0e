"""Tail batching's abort on a real Ray actor (``envs/abort.py``): the registry's long poll, the agent-loop process's
watch, and a call in flight cut when its group is aborted."""

from __future__ import annotations

import asyncio
import time

import pytest

from thundersync_verl.envs.abort import REGISTRY_NAME, WATCH_TIMEOUT_S, AbortCheck, AbortWatch, GroupAborted, start_registry

CALL_BOUND_S = 60.0  # a call that is never cut would hang: fail instead


@pytest.fixture(scope="module")
def registry():
    from thundersync_harness.engine_setup import ray_session

    with ray_session() as ray_tmp:
        import ray

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=ray_tmp)
        yield start_registry()


def _clear(registry, *uids) -> None:
    import ray

    ray.get(registry.discard.remote(list(uids)))


def test_the_registry_answers_a_watch_when_its_set_changes_and_at_once_for_an_old_epoch(registry):
    import ray

    epoch, uids = ray.get(registry.watch.remote(-1, 0.0))
    waiting = registry.watch.remote(epoch, 30.0)
    ready, _ = ray.wait([waiting], timeout=0.5)
    assert not ready  # nothing changed: the long poll holds
    ray.get(registry.add.remote(["w1", "w2"]))
    new_epoch, new_uids = ray.get(waiting, timeout=CALL_BOUND_S)
    assert new_epoch == epoch + 1 and set(new_uids) == set(uids) | {"w1", "w2"}
    assert ray.get(registry.watch.remote(epoch, 30.0), timeout=CALL_BOUND_S) == (new_epoch, new_uids)  # old epoch
    assert ray.get(registry.watch.remote(new_epoch, 0.01)) == (new_epoch, new_uids)  # timed out unchanged
    _clear(registry, "w1", "w2")
    assert "w1" not in ray.get(registry.watch.remote(new_epoch, 30.0), timeout=CALL_BOUND_S)[1]


def test_a_call_in_flight_is_cut_when_its_group_is_aborted_and_the_others_run_on(registry):
    check = AbortCheck(enabled=True)
    seen: dict[str, str] = {}

    async def call(name: str, release: asyncio.Event):
        try:
            await release.wait()
            seen[name] = "finished"
            return name
        except asyncio.CancelledError:
            seen[name] = "cancelled"
            raise

    async def scenario():
        release = asyncio.Event()  # set only after the abort: a call can end before it only by being cut
        cut = asyncio.ensure_future(check.unless_aborted("a1", call("a1", release)))
        kept = asyncio.ensure_future(check.unless_aborted("k1", call("k1", release)))
        await asyncio.sleep(0.2)
        await registry.add.remote(["a1"])
        with pytest.raises(GroupAborted, match="prompt a1: aborted by thundersync.tail"):
            await asyncio.wait_for(cut, CALL_BOUND_S)
        assert seen == {"a1": "cancelled"} and not kept.done()
        release.set()
        assert await asyncio.wait_for(kept, CALL_BOUND_S) == "k1"
        never = call("a1-next", release)
        with pytest.raises(GroupAborted):  # the next call of an aborted group is never started
            await check.unless_aborted("a1", never)
        assert "a1-next" not in seen
        assert not AbortWatch.current()._waiters  # no future left behind

    asyncio.run(scenario())
    assert seen == {"a1": "cancelled", "k1": "finished"}
    _clear(registry, "a1")


def test_without_tail_batching_no_registry_is_asked(registry):
    async def scenario():
        return await AbortCheck(enabled=False).unless_aborted("a1", asyncio.sleep(0, result="ran"))

    import ray

    ray.get(registry.add.remote(["a1"]))
    assert asyncio.run(scenario()) == "ran"
    _clear(registry, "a1")


def test_the_cpu_engine_stops_an_aborted_groups_call_and_only_when_named(registry, tiny_random_lm):
    from types import SimpleNamespace

    from thundersync_verl.backends.cpu.rollout import HFCpuServer
    from thundersync_verl.envs.abort import ABORT_UID_KEY

    config = SimpleNamespace(dtype="float32", max_model_len=256, prompt_length=48, response_length=200, engine_kwargs={})
    server = HFCpuServer(config, SimpleNamespace(local_path=str(tiny_random_lm)), None, 0)
    prompt = server.engine.tokenizer.encode("<|im_start|>user\nCompute `3+4`.<|im_end|>\n<|im_start|>assistant\n")
    params = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def scenario():
        named = asyncio.ensure_future(server.generate(prompt, params, request_id="r1", **{ABORT_UID_KEY: "s1"}))
        other = asyncio.ensure_future(server.generate(prompt, params, request_id="r2", **{ABORT_UID_KEY: "s2"}))
        await asyncio.sleep(0.1)
        await registry.add.remote(["s1"])
        cut = await asyncio.wait_for(named, CALL_BOUND_S)
        return cut, await asyncio.wait_for(other, CALL_BOUND_S)

    cut, other = asyncio.run(scenario())
    assert cut.stop_reason == "aborted" and len(cut.token_ids) < 200
    assert other.stop_reason == "completed" and len(other.token_ids) == 200  # another group's call runs to its end
    assert AbortCheck(True, "hf_cpu").server_kwargs("s1") == {ABORT_UID_KEY: "s1"}
    assert AbortCheck(True, "vllm").server_kwargs("s1") == {}  # vLLM's server takes no such argument
    assert AbortCheck(False, "hf_cpu").server_kwargs("s1") == {} == AbortCheck(True, "hf_cpu").server_kwargs(None)
    _clear(registry, "s1")


def test_the_registry_is_the_jobs_own(registry):
    import ray

    from thundersync_verl.backends.mailbox import job_scoped

    assert ray.get_actor(job_scoped(REGISTRY_NAME))._actor_id == registry._actor_id
    with pytest.raises(ValueError):
        ray.get_actor(REGISTRY_NAME)  # no unscoped registry that a second job in the namespace would share


def test_the_watch_finds_a_restarted_registry(registry):
    import ray

    async def scenario():
        check = AbortCheck(enabled=True)
        assert await check.unless_aborted("r1", asyncio.sleep(0, result=1)) == 1  # the watch follows the registry
        ray.kill(registry)  # the trainer's registry is gone (a restart makes a new one under the same name)
        await asyncio.sleep(0.3)
        fresh = start_registry()
        await fresh.add.remote(["r1"])
        with pytest.raises(GroupAborted):
            await asyncio.wait_for(check.unless_aborted("r1", asyncio.Event().wait()), CALL_BOUND_S)
        return fresh

    fresh = asyncio.run(scenario())
    _clear(fresh, "r1")


def test_a_finished_event_loop_leaves_no_watch_behind(registry):
    """One watch per event loop; the watch follows the registry with a task of that loop. When ``asyncio.run`` ends,
    the cancelled task drops what it held of the loop, so the loop and its watch are collected."""
    import gc

    async def scenario():
        check = AbortCheck(enabled=True)
        assert await check.unless_aborted("leak", asyncio.sleep(0, result=2)) == 2

    before = len(AbortWatch._by_loop)
    asyncio.run(scenario())
    asyncio.run(scenario())
    deadline = time.time() + WATCH_TIMEOUT_S / 3  # the cancelled long polls' replies release the loops: a round trip
    gc.collect()
    while len(AbortWatch._by_loop) > before and time.time() < deadline:
        time.sleep(0.05)
        gc.collect()
    assert len(AbortWatch._by_loop) <= before
