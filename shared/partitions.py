"""Which aggregator partition an instance belongs to.

Instances are spread over `count` partitions by the FNV-1a hash of the instance's subject
token, the hash NATS subject mapping's `partition(count, ...)` uses: a server-side mapping
such as `rankscope.placement.*` -> `part.{{partition(4,1)}}.{{wildcard(1)}}` routes each
instance to the partition this module names for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankscope.shared.subjects import Subjects, token

__all__ = ["MAX_PARTITIONS", "Partition", "partition_of"]

MAX_PARTITIONS = 256
"""Most partitions a deployment may be cut into (far more than any needs)."""

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


def partition_of(subject_token: str, count: int) -> int:
    """The partition (0 to `count` - 1) of a subject token, as NATS's `partition()`."""
    hashed = _FNV_OFFSET
    for byte in subject_token.encode():
        hashed = ((hashed ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return hashed % count


@dataclass(frozen=True, slots=True)
class Partition:
    """Partition `index` of `count`: the instances one aggregator folds and answers for."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be 1 to {MAX_PARTITIONS}, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(
                f"partition must be 0 to {self.count - 1} (of {self.count}), got {self.index}"
            )

    @property
    def whole(self) -> bool:
        """Whether this is the only partition (it holds every instance)."""
        return self.count == 1

    @property
    def name(self) -> str:
        """`<index>-of-<count>`, as in its query subjects and snapshot file."""
        return f"{self.index}-of-{self.count}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, raw_id: str) -> bool:
        """Whether the instance (or node) of that id belongs to this partition."""
        return self.whole or partition_of(token(raw_id), self.count) == self.index

    def owns_subject(self, subject: str, subjects: Subjects) -> bool:
        """Whether a telemetry, placement or task subject is of one of this partition's
        instances (a subject naming no instance belongs to partition 0)."""
        if self.whole:
            return True
        found = subjects.instance_token(subject)
        owner = 0 if found is None else partition_of(found, self.count)
        return owner == self.index
