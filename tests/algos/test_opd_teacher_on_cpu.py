"""Teacher scoring of OPD turns: prefix == whole sequence, retries, timeouts, refusals. No GPU, no Ray."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from thundersync_harness.teacher import HFTeacherScorer, TurnScorer
from thundersync_verl.algos.opd.turn_teacher import TeacherRetryPolicy, TeacherScoringError
from thundersync_verl.core import StreamingInputError

VOCAB = 128
# prompt 0..9, turn 0 = 10..17, observation 18..23, turn 1 = 24..31, observation 32..35, turn 2 = 36..43
SPANS = [(10, 18), (24, 32), (36, 44)]


@pytest.fixture(scope="module")
def teacher():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(1)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         attn_implementation="sdpa", initializer_range=0.2)
    torch.manual_seed(0)
    return HFTeacherScorer(Qwen2ForCausalLM(config))


@pytest.fixture(scope="module")
def sequence():
    return torch.randint(0, VOCAB, (44,), generator=torch.Generator().manual_seed(1)).tolist()


def _manual(teacher, ids, start, end):
    """log softmax(logits_{p-1})[x_p] for p in [start, end), from one whole-sequence forward."""
    with torch.no_grad():
        logits = teacher.model(input_ids=torch.tensor([ids])).logits[0]  # [L, V]
    logp = torch.log_softmax(logits.float(), dim=-1)  # [L, V]
    return torch.stack([logp[p - 1, ids[p]] for p in range(start, end)])


def test_prefix_and_incremental_scores_equal_whole_sequence_scores(teacher, sequence):
    whole = teacher.score(sequence, (1, len(sequence)))
    assert torch.allclose(whole, _manual(teacher, sequence, 1, len(sequence)), atol=1e-6)  # the convention
    session = teacher.session()
    for start, end in SPANS:
        ref = whole[start - 1 : end - 1]
        prefix = teacher.score(sequence[:end], (start, end))
        incremental = session.score(sequence[:end], (start, end))
        assert prefix.shape == incremental.shape == (end - start,)
        assert float((prefix - ref).abs().max()) < 1e-5 and float((incremental - ref).abs().max()) < 1e-5
    assert session.ids == sequence[: SPANS[-1][1]]  # every token fed once


def test_session_answers_an_earlier_turn_after_a_later_one(teacher, sequence):
    session = teacher.session()
    late = session.score(sequence[:44], (36, 44))
    early = session.score(sequence[:18], (10, 18))  # answered from the stored log-probs, no new forward
    assert len(session.ids) == 44
    whole = teacher.score(sequence, (1, 44))
    assert torch.allclose(early, whole[9:17], atol=1e-5) and torch.allclose(late, whole[35:43], atol=1e-5)


def test_session_refuses_a_different_history(teacher, sequence):
    session = teacher.session()
    session.score(sequence[:18], (10, 18))
    other = list(sequence[:32])
    other[3] = (other[3] + 1) % VOCAB
    with pytest.raises(StreamingInputError, match="first difference at position 3"):
        session.score(other, (24, 32))


@pytest.mark.parametrize("span", [(0, 5), (5, 5), (7, 3), (10, 99), ("a", 2)])
def test_bad_spans_are_refused(teacher, sequence, span):
    with pytest.raises(StreamingInputError, match="1 <= start < end"):
        teacher.score(sequence, span)


class FlakyTeacher:
    """Fails the first ``failures`` calls (raising, or corrupting then raising), then works."""

    def __init__(self, inner: HFTeacherScorer, failures: int, mode: str = "raise", delay: float = 0.0):
        self.inner, self.failures, self.mode, self.delay, self.calls = inner, failures, mode, delay, 0
        # mode "slow": the call blocks until ``release`` is set (or ``delay`` passes); ``slow_done`` is set after,
        # ``released`` says which of the two ended it
        self.release, self.slow_done, self.released = threading.Event(), threading.Event(), None

    def session(self):
        backend = self

        class Session:
            def __init__(self):
                self.real = backend.inner.session()

            def score(self, prefix_ids, span):
                backend.calls += 1
                if backend.calls <= backend.failures:
                    if backend.mode == "corrupt":  # feed a wrong history into this session, then fail
                        self.real.score([1] * len(prefix_ids), (1, len(prefix_ids)))
                        raise ConnectionError("teacher server reset")
                    if backend.mode == "slow":
                        backend.released = backend.release.wait(backend.delay)
                        backend.slow_done.set()
                    elif backend.mode == "nan":
                        return torch.full((span[1] - span[0],), float("nan"))
                    elif backend.mode == "short":
                        return torch.zeros(1)
                    else:
                        raise ConnectionError("teacher server unavailable")
                return self.real.score(prefix_ids, span)

        return Session()


def test_transient_failures_are_retried_with_a_fresh_session(teacher, sequence):
    backend = FlakyTeacher(teacher, failures=2, mode="corrupt")
    scorer = TurnScorer(backend, TeacherRetryPolicy(max_attempts=3))
    values = scorer.score_turn("traj-a", 1, sequence[:32], (24, 32))
    assert torch.allclose(values, teacher.score(sequence, (1, 44))[23:31], atol=1e-5)  # not the corrupted cache
    assert scorer.stats.failures == 2 and scorer.stats.attempts == 3 and scorer.pending() == []
    assert "teacher server reset" in scorer.stats.errors[0]


@pytest.mark.parametrize("mode, reason", [("raise", "unavailable"), ("nan", "non-finite"), ("short", "returned 1 log-probs")])
def test_a_turn_that_keeps_failing_raises_and_stays_pending(teacher, sequence, mode, reason):
    backend = FlakyTeacher(teacher, failures=10, mode=mode)
    slept = []
    scorer = TurnScorer(backend, TeacherRetryPolicy(max_attempts=2, backoff_s=0.5), sleep=slept.append)
    with pytest.raises(TeacherScoringError, match=rf"turn 2 of trajectory 'traj-b' after 2 attempt\(s\).*{reason}") as err:
        scorer.score_turn("traj-b", 2, sequence, (36, 44))
    assert "kept pending" in str(err.value) and "fix the teacher backend" in str(err.value)
    assert scorer.pending() == [("traj-b", 2)] and slept == [0.5]
    backend.failures = 0  # the teacher recovers: scoring the turn again clears it
    scorer.score_turn("traj-b", 2, sequence, (36, 44))
    assert scorer.pending() == []


def test_a_call_past_the_timeout_is_retried(teacher, sequence):
    backend = FlakyTeacher(teacher, failures=1, mode="slow", delay=60.0)
    scorer = TurnScorer(backend, TeacherRetryPolicy(max_attempts=2, timeout_s=2.0))  # 2 s: 10x a tiny forward here
    values = scorer.score_turn("traj-c", 0, sequence[:18], (10, 18))
    backend.release.set()  # only now may the first call end: the retry did not wait for it
    assert backend.slow_done.wait(60.0) and backend.released is True
    assert scorer.stats.timeouts == 1 and values.shape == (8,)
    assert torch.allclose(values, teacher.score(sequence[:18], (10, 18)), atol=1e-5)


def test_input_errors_are_not_retried(teacher, sequence):
    backend = FlakyTeacher(teacher, failures=0)
    scorer = TurnScorer(backend, TeacherRetryPolicy(max_attempts=5))
    with pytest.raises(StreamingInputError, match="1 <= start < end"):
        scorer.score_turn("t", 0, sequence, (0, 3))
    assert backend.calls == 0


@pytest.mark.parametrize("kwargs", [{"max_attempts": 0}, {"timeout_s": 0.0}, {"backoff_s": -1.0}])
def test_retry_policy_validation(kwargs):
    with pytest.raises(StreamingInputError, match="max_attempts >= 1"):
        TeacherRetryPolicy(**kwargs)


def test_async_scoring_and_the_hf_cpu_engine_model(teacher, sequence):
    from thundersync_verl.backends.cpu.hf_engine import HFGenerationEngine

    scorer = HFTeacherScorer.from_engine(HFGenerationEngine(teacher.model))
    assert scorer.model is teacher.model
    values = asyncio.run(TurnScorer(scorer).score_turn_async("t", 0, sequence[:18], (10, 18)))
    assert torch.allclose(values, teacher.score(sequence[:18], (10, 18)), atol=1e-6)
