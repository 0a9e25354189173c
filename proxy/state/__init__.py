"""Shared routing state: one interface, an in-memory and a Redis implementation."""

from proxy.state.base import SlotRecord, SlotRef, StateStore, StateStoreUnavailable
from proxy.state.memory import InMemoryStateStore

__all__ = ["InMemoryStateStore", "SlotRecord", "SlotRef", "StateStore", "StateStoreUnavailable"]
