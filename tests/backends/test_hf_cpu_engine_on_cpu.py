"""The hf_cpu generation engine: concurrency, stop conditions, log-probs, weight updates, aborts."""

from __future__ import annotations

import asyncio

import pytest
import torch

from thundersync_verl.backends.cpu.hf_engine import HFGenerationEngine, SamplingSpec
from thundersync_verl.backends.cpu.rollout import eos_ids_of, load_hf_model


@pytest.fixture()
def engine(tiny_random_lm):
    model, tokenizer = load_hf_model(str(tiny_random_lm))
    return HFGenerationEngine(model, tokenizer, eos_token_ids=eos_ids_of(model, tokenizer), max_model_len=256)


def _prompt(engine):
    return engine.tokenizer.encode("<|im_start|>user\nCompute `3+4`.<|im_end|>\n<|im_start|>assistant\n")


def test_max_tokens_and_logprobs_match_a_full_forward(engine):
    out = asyncio.run(engine.generate(_prompt(engine), {"max_tokens": 12, "temperature": 1.0, "ignore_eos": True, "seed": 3}))
    assert len(out.token_ids) == 12 and out.stop_reason == "length"
    ids = torch.tensor([_prompt(engine) + out.token_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(_prompt(engine)) - 1 : -1]  # [T, V]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.log_probs), ref, atol=1e-5)


def test_temperature_scales_the_reported_logprob(engine):
    out = asyncio.run(engine.generate(_prompt(engine), {"max_tokens": 4, "temperature": 0.5, "ignore_eos": True, "seed": 1}))
    ids = torch.tensor([_prompt(engine) + out.token_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(_prompt(engine)) - 1 : -1] / 0.5
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.log_probs), ref, atol=1e-5)


def test_greedy_is_deterministic_and_stop_token_ends_generation(engine):
    a = asyncio.run(engine.generate(_prompt(engine), {"max_tokens": 8, "temperature": 0, "ignore_eos": True}))
    b = asyncio.run(engine.generate(_prompt(engine), {"max_tokens": 8, "temperature": 0, "ignore_eos": True}))
    assert a.token_ids == b.token_ids
    stop_at = a.token_ids[2]
    c = asyncio.run(engine.generate(_prompt(engine), {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop_at]}))
    assert c.stop_reason == "completed" and c.token_ids[-1] == stop_at and len(c.token_ids) == a.token_ids.index(stop_at) + 1


def test_stop_string_ends_generation(engine):
    a = asyncio.run(engine.generate(_prompt(engine), {"max_tokens": 10, "temperature": 0, "ignore_eos": True}))
    text = engine.tokenizer.decode(a.token_ids[:3], skip_special_tokens=False)
    stop = text[-2:] if len(text) >= 2 else text
    b = asyncio.run(engine.generate(_prompt(engine), {"max_tokens": 10, "temperature": 0, "ignore_eos": True, "stop": [stop]}))
    assert b.stop_reason == "completed" and len(b.token_ids) <= 3


def test_top_p_tiny_keeps_only_the_argmax(engine):
    greedy = asyncio.run(engine.generate(_prompt(engine), {"max_tokens": 6, "temperature": 0, "ignore_eos": True}))
    nucleus = asyncio.run(engine.generate(_prompt(engine), {"max_tokens": 6, "temperature": 1.0, "top_p": 1e-6, "ignore_eos": True, "seed": 9}))
    assert nucleus.token_ids == greedy.token_ids


def test_requests_interleave_so_short_ones_finish_first(engine):
    async def run():
        finished = []

        async def one(name, n):
            await engine.generate(_prompt(engine), {"max_tokens": n, "ignore_eos": True, "seed": 0})
            finished.append(name)

        await asyncio.gather(one("long", 120), one("short", 5), one("short2", 5))
        return finished

    finished = asyncio.run(run())
    assert finished.index("long") == 2, finished
    assert engine.peak_active == 3


def test_weight_update_changes_outputs_and_versions(engine):
    before = asyncio.run(engine.generate(_prompt(engine), {"max_tokens": 6, "temperature": 0, "ignore_eos": True}))
    new = [(n, torch.randn_like(p)) for n, p in engine.model.named_parameters()]
    assert engine.load_weights(new, version=7) == len(new)
    after = asyncio.run(engine.generate(_prompt(engine), {"max_tokens": 6, "temperature": 0, "ignore_eos": True}))
    assert after.min_version == after.max_version == 7
    assert after.token_ids != before.token_ids or after.log_probs != before.log_probs


def test_weight_update_rejects_wrong_names_and_shapes(engine):
    with pytest.raises(KeyError, match="does not exist"):
        engine.load_weights([("no.such.weight", torch.zeros(1))])
    name, p = next(iter(engine.model.named_parameters()))
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([(name, torch.zeros(p.numel() + 1))])


def test_abort_returns_in_flight_requests_and_parks_new_ones(engine):
    async def run():
        task = asyncio.create_task(engine.generate(_prompt(engine), {"max_tokens": 200, "ignore_eos": True}))
        await asyncio.sleep(0.05)
        engine.abort_all()
        aborted = await asyncio.wait_for(task, 2.0)
        parked = asyncio.create_task(engine.generate(_prompt(engine), {"max_tokens": 3, "ignore_eos": True}))
        await asyncio.sleep(0.05)
        assert not parked.done()
        engine.resume()
        return aborted, await asyncio.wait_for(parked, 2.0)

    aborted, later = asyncio.run(run())
    assert aborted.stop_reason == "aborted" and len(aborted.token_ids) < 200
    assert later.stop_reason == "length" and len(later.token_ids) == 3


def test_a_stopped_or_cancelled_request_leaves_the_batch_and_the_others_run_on(engine):
    long = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def run():
        stop = asyncio.get_running_loop().create_future()
        stopped = asyncio.create_task(engine.generate(_prompt(engine), long, stop=stop))
        dropped = asyncio.create_task(engine.generate(_prompt(engine), long))
        kept = asyncio.create_task(engine.generate(_prompt(engine), {**long, "max_tokens": 40}))
        await asyncio.sleep(0.05)
        stop.set_result(None)  # the caller's group was aborted
        dropped.cancel()  # the caller stopped waiting
        out = await asyncio.wait_for(stopped, 5.0)
        with pytest.raises(asyncio.CancelledError):
            await dropped
        busy = len(engine._running) + len(engine._waiting)
        done = await asyncio.wait_for(kept, 30.0)
        return out, done, busy, len(engine._running) + len(engine._waiting)

    out, kept, busy_after, left = asyncio.run(run())
    assert out.stop_reason == "aborted" and len(out.token_ids) < 200
    assert busy_after <= 1  # at most the kept request decodes on
    assert left == 0  # the cancelled one (200 tokens asked, 40 for the kept one) is not decoding any more
    assert kept.stop_reason == "length" and len(kept.token_ids) == 40
    solo = asyncio.run(engine.generate(_prompt(engine), {"max_tokens": 40, "ignore_eos": True, "temperature": 0}))
    assert solo.token_ids == kept.token_ids  # the aborts changed nothing for the request that ran on


def test_bad_sampling_params_and_overlong_prompt_fail_clearly(engine):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingSpec.from_params({"max_tokens": 0}, default_max_tokens=5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingSpec.from_params({"top_p": 0.0}, default_max_tokens=5)
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(engine.generate(list(range(300)), {"max_tokens": 2}))


def test_missing_model_folder_says_how_to_build(tmp_path):
    with pytest.raises(FileNotFoundError, match="thundersync build-model"):
        load_hf_model(str(tmp_path / "nope"))


def test_batched_forward_matches_one_row_at_a_time(engine):
    from thundersync_verl.backends.cpu import kv_batch

    torch.manual_seed(0)
    prompts = [torch.randint(4, 300, (n,)).tolist() for n in (3, 11, 29)]
    logits, caches = kv_batch.prefill(engine.model, prompts, engine.pad_token_id)
    seqs = [list(p) for p in prompts]
    for _ in range(5):
        with torch.no_grad():
            for seq, row in zip(seqs, logits):
                ref = engine.model(torch.tensor([seq])).logits[0, -1]
                assert torch.allclose(row, ref, atol=1e-4, rtol=0), (row - ref).abs().max()
        tokens = [int(torch.argmax(row)) for row in logits]
        for seq, tok in zip(seqs, tokens):
            seq.append(tok)
        logits, caches = kv_batch.decode(engine.model, tokens, caches)
    assert [c[0][0].shape[2] for c in caches] == [len(s) for s in seqs]  # caches cut back to true lengths


def test_concurrent_requests_share_forwards_and_match_solo_greedy(engine):
    prompts = [_prompt(engine), engine.tokenizer.encode("<|im_start|>user\nCompute `12*7`.<|im_end|>\n")]
    greedy = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    solo = [asyncio.run(engine.generate(p, greedy)).token_ids for p in prompts]
    calls = []
    hook = engine.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        async def together():
            return await asyncio.gather(*[engine.generate(p, greedy) for p in prompts for _ in range(4)])

        outs = asyncio.run(together())
    finally:
        hook.remove()
    assert [o.token_ids for o in outs] == [solo[0]] * 4 + [solo[1]] * 4
    # 8 requests x 10 tokens: one prefill + 9 decode forwards for the batch, + 8 rescoring forwards
    assert len(calls) <= 1 + 9 + 8, len(calls)


def test_max_batch_bounds_rows_per_forward_without_starving_anyone(engine):
    engine.max_batch = 3
    rows = []
    hook = engine.model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                                  with_kwargs=True)
    try:
        async def many():
            return await asyncio.gather(*[engine.generate(_prompt(engine), {"max_tokens": 4, "ignore_eos": True, "seed": i})
                                          for i in range(7)])

        outs = asyncio.run(many())
    finally:
        hook.remove()
    assert all(len(o.token_ids) == 4 for o in outs)
    assert max(rows) == 3


def test_concurrent_scoring_calls_run_unpadded_one_by_one_in_order_and_equal_a_solo_forward(engine):
    seqs = [_prompt(engine), _prompt(engine)[:9], list(range(4, 60))]
    shapes = []  # each forward's input: no padding to the longest
    hook = engine.model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(kwargs["input_ids"].shape),
                                                  with_kwargs=True)
    try:
        async def together():
            return await asyncio.gather(*[engine.score(s) for s in seqs])

        rows = asyncio.run(together())
    finally:
        hook.remove()
    assert shapes == [torch.Size([1, len(s)]) for s in seqs]  # first come, first served
    with torch.no_grad():
        for seq, row in zip(seqs, rows):
            ref = engine.model(input_ids=torch.tensor([seq])).logits[0].float()  # [L, V]
            assert row.shape == ref.shape and torch.equal(row, ref)
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(engine.score(list(range(300))))


@pytest.mark.parametrize("lengths, groups", [
    ([300, 300, 300, 300], [[0, 1, 2, 3]]),  # equal lengths: one forward
    ([60, 200, 400, 700], [[3], [2], [1], [0]]),  # a multi-turn mix: each alone, longest first
    ([20, 100, 19, 95, 98], [[1, 4, 3], [0, 2]]),  # two length classes
    ([5], [[0]]),
])
def test_prefill_groups_prompts_of_similar_length(lengths, groups):
    from thundersync_verl.backends.cpu import kv_batch

    assert kv_batch.length_groups(lengths) == groups
    assert kv_batch.length_groups(lengths, None) == [list(range(len(lengths)))]  # the old single padded batch


def test_prefill_groups_cover_every_prompt_once_and_pad_no_row_beyond_the_share():
    import random

    from thundersync_verl.backends.cpu import kv_batch

    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 800) for _ in range(rng.randint(1, 40))]
        share = rng.choice([0.0, 0.1, 0.25, 0.5])
        groups = kv_batch.length_groups(lengths, share)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            width = max(lengths[i] for i in g)
            assert all(width - lengths[i] <= share * width for i in g)
    with pytest.raises(ValueError, match="pad_share"):
        kv_batch.length_groups([3, 4], 1.0)


def test_concurrent_prompts_of_mixed_lengths_prefill_in_groups_and_match_solo_greedy(engine):
    from thundersync_verl.backends.cpu import kv_batch

    base = _prompt(engine)
    prompts = [base, base + list(range(4, 120)), base[:12], base + list(range(4, 118))]
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    solo = [asyncio.run(engine.generate(p, greedy)).token_ids for p in prompts]
    widths = []  # each prefill forward's [rows, width]
    hook = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape))
        if kwargs.get("past_key_values") is None and kwargs["input_ids"].shape[1] > 1 and "attention_mask" in kwargs
        else None, with_kwargs=True)
    try:
        async def together():
            return await asyncio.gather(*[engine.generate(p, greedy) for p in prompts])

        outs = asyncio.run(together())
    finally:
        hook.remove()
    assert [o.token_ids for o in outs] == solo
    lengths = [len(p) for p in prompts]
    expected = [(len(g), max(lengths[i] for i in g)) for g in kv_batch.length_groups(lengths)]
    assert widths == expected == [(2, len(prompts[1])), (2, len(prompts[0]))]  # no short row padded to the long ones
