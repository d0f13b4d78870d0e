"""verl's replay buffers with a short poll interval, plugged in through ``trainer.v1.sampler.custom_sampler``.

verl's V1 replay buffers check the TransferQueue every 2 s (a constructor default, not a config
key), so a Sync step's rollout phase is rounded up to the next 2 s tick. That is an artefact, not
a property of synchronous training: mode comparisons use these subclasses, identical to verl's
except that ``sampler_kwargs.poll_interval`` (default 0.02 s) sets the interval.
"""

from __future__ import annotations

from thundersync_verl import verl_adapter as va

DEFAULT_POLL_S = 0.02
_sync_base, _async_base = va.replay_buffer_classes()


def _poll(sampler_kwargs) -> float:
    value = float((sampler_kwargs or {}).get("poll_interval", DEFAULT_POLL_S))
    if not value > 0:
        raise ValueError(f"trainer.v1.sampler.sampler_kwargs.poll_interval must be > 0 seconds, got {value}")
    return value


class FastPollReplayBuffer(_sync_base):
    """verl's sync ReplayBuffer, polling every ``sampler_kwargs.poll_interval`` seconds."""

    def __init__(self, *args, sampler_kwargs=None, **kwargs):
        kwargs.setdefault("poll_interval", _poll(sampler_kwargs))
        super().__init__(*args, sampler_kwargs=sampler_kwargs, **kwargs)


class FastPollReplayBufferAsync(_async_base):
    """verl's ReplayBufferAsync, polling every ``sampler_kwargs.poll_interval`` seconds."""

    def __init__(self, *args, sampler_kwargs=None, **kwargs):
        kwargs.setdefault("poll_interval", _poll(sampler_kwargs))
        super().__init__(*args, sampler_kwargs=sampler_kwargs, **kwargs)
