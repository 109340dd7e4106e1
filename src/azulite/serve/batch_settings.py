"""A model's batching settings as the batcher reads them from its config: Triton's ``dynamic_batching``
(preferred sizes, max_queue_delay, preserve_ordering, priority levels and their queue policies) or the
oldest sequence batcher's, or none (one request per execution)."""

from __future__ import annotations

from dataclasses import dataclass

from azulite.serve.proto import model_config_pb2 as mc


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    delay_on_timeout: bool = False  # timeout_action DELAY (else REJECT)
    default_timeout_us: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0  # 0: unbounded

    @classmethod
    def from_proto(cls, policy: mc.ModelQueuePolicy) -> "QueuePolicy":
        return cls(
            delay_on_timeout=policy.timeout_action == mc.ModelQueuePolicy.DELAY,
            default_timeout_us=policy.default_timeout_microseconds,
            allow_timeout_override=policy.allow_timeout_override,
            max_queue_size=policy.max_queue_size,
        )


@dataclass(frozen=True, slots=True)
class BatcherSettings:
    max_batch_size: int = 0
    dynamic: bool = False
    preferred: tuple[int, ...] = ()
    max_delay_ns: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 1
    default_level: int = 1
    policies: tuple[QueuePolicy, ...] = (QueuePolicy(),)

    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> "BatcherSettings":
        if config.sequence_batching.HasField("oldest") and config.max_batch_size > 0:
            # the oldest strategy batches requests of different sequences (serve/sequence.py keeps one
            # request per sequence in flight, so a batch never holds two steps of one sequence)
            oldest = config.sequence_batching.oldest
            return cls(max_batch_size=config.max_batch_size, dynamic=True,
                       preferred=_preferred(oldest.preferred_batch_size, config.max_batch_size),
                       max_delay_ns=oldest.max_queue_delay_microseconds * 1000)
        if not config.HasField("dynamic_batching") or config.max_batch_size == 0:
            return cls(max_batch_size=config.max_batch_size)
        db = config.dynamic_batching
        levels = max(1, db.priority_levels)
        default = QueuePolicy.from_proto(db.default_queue_policy)
        policies = tuple(
            QueuePolicy.from_proto(db.priority_queue_policy[level]) if level in db.priority_queue_policy else default
            for level in range(1, levels + 1)
        )
        return cls(
            max_batch_size=config.max_batch_size,
            dynamic=True,
            preferred=_preferred(db.preferred_batch_size, config.max_batch_size),
            max_delay_ns=db.max_queue_delay_microseconds * 1000,
            preserve_ordering=db.preserve_ordering,
            priority_levels=levels,
            default_level=db.default_priority_level or levels,
            policies=policies,
        )


def _preferred(sizes, max_batch_size: int) -> tuple[int, ...]:
    """The preferred sizes that change when a batch leaves: a full batch leaves at once anyway, so
    ``max_batch_size`` (what Triton's normalized config lists when the config names none) is left out,
    and with it the scheduler pass per request a preferred size costs (batcher.submit)."""
    return tuple(sorted({size for size in sizes if size < max_batch_size}))
