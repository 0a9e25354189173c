"""Shared routing state: one interface, an in-memory and a Redis implementation."""

from proxy.state.base import SlotRecord, SlotRef, SlotView, StateStore, StateStoreUnavailable
from proxy.state.memory import InMemoryStateStore

__all__ = [
    "InMemoryStateStore",
    "SlotRecord",
    "SlotRef",
    "SlotView",
    "StateStore",
    "StateStoreUnavailable",
]
