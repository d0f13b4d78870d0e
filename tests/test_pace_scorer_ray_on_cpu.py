"""PACE's scorer finds the rollout servers of a Ray job by name and re-scores on the one with the newest weights.

Two real hf_cpu servers run as named Ray actors, as verl's LLMServerManager starts them in separate_async (a
hybrid replica that keeps its first weights while the learner trains, a standalone one that receives every
push); the scorer must pick the standalone one and return its log-probs, checked against a causal forward
of the same weights in this process, and leave the hybrid one out once it parks requests.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.slow  # starts a Ray cluster (~10 s)

CONFIG = SimpleNamespace(dtype="float32", max_model_len=256, prompt_length=48, response_length=64, engine_kwargs={})


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from thundersync_harness import engine_setup as setup

    with setup.ray_session() as ray_tmp:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(ray_tmp))
        yield


def test_discovered_scorer_uses_the_server_with_the_newest_weights(ray_cluster):
    import ray

    from thundersync_verl.backends.cpu.rollout import HFCpuServer, load_hf_model
    from thundersync_verl.models import ensure_tiny_models
    from thundersync_verl.algos.pace.pace_scorer import RolloutServerScorer

    path = str(ensure_tiny_models(variants=("student",), progress=False)["student"])
    actor = ray.remote(HFCpuServer)
    servers = [actor.options(name=f"hf_cpu_server_{rank}", max_concurrency=8).remote(
        CONFIG, SimpleNamespace(local_path=path), None, rank) for rank in (0, 1)]
    model, tokenizer = load_hf_model(path)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    ray.get(servers[1].update_weights.remote(list(model.state_dict().items()), global_steps=3))  # the pushed one

    scorer = RolloutServerScorer.discover()
    assert sorted(ep.name for ep in scorer.endpoints) == ["hf_cpu_server_0", "hf_cpu_server_1"]
    prompt = tokenizer.encode("<|im_start|>user\nCompute `3+4`.<|im_end|>\n<|im_start|>assistant\n")
    response = tokenizer.encode("The answer is 7.")
    (lp,), version = scorer.score([(prompt, response)])
    assert version == 3
    ids = torch.tensor([prompt + response])  # [1, P + R]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()  # [R, V]
    direct = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]  # [R]
    assert (lp - direct).abs().max() < 1e-4
    # verl lends the hybrid replica back to the learner: aborted with reject_request, it parks new requests
    ray.get(servers[0].abort_all_requests.remote(reject_request=True))
    scorer = RolloutServerScorer.discover()
    scorer.probe_timeout_s = 1.0
    (again,), version = scorer.score([(prompt, response)])
    assert version == 3 and scorer.parked == {"hf_cpu_server_0"}
    assert (again - direct).abs().max() < 1e-4
