"""Redis key names, in one versioned namespace. Every key written has a TTL, except the
snapshot index, which the disk budget bounds."""

from __future__ import annotations

PREFIX = "llp:v1:"


def affinity(key: str) -> str:
    return f"{PREFIX}aff:{key}"


def lease(backend: str, slot: int) -> str:
    return f"{PREFIX}lease:{backend}:{slot}"


def slot(backend: str, slot_id: int) -> str:
    return f"{PREFIX}slot:{backend}:{slot_id}"


def window(name: str) -> str:
    return f"{PREFIX}win:{name}"


def release(key: int) -> str:
    return f"{PREFIX}ret:{key}"


def claimed(release_id: str) -> str:
    return f"{PREFIX}retd:{release_id}"


SNAPSHOTS = f"{PREFIX}snapshots"
REPLICAS = f"{PREFIX}replicas"  # sorted set: replica id -> when its heartbeat expires
