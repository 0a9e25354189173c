"""Which slots a replica may pin while the shared state store is unreachable.

Leases live in the store, so without it a replica's leases are only local claims, and two
replicas routing on their own pictures would pin the same slot (on llama-server a request
pinned to a busy slot can overwrite the running generation's KV). So, while the store is
down, replicas that knew each other split the fleet instead of sharing it:

- every replica keeps a heartbeat in the store and reads the list of live replicas
  (``StateStore.replicas``) while it can; that last list is what it knows when the store
  goes away;
- number the slots of the whole fleet in configuration order, backend by backend
  (``position = slots of the backends before it + slot id``); slot ``position`` belongs to
  the replica ranked ``position mod n`` among the ``n`` sorted replica ids. With 2 replicas
  on 2 backends x 2 slots, each gets one slot of each backend, so both keep every backend;
- a replica that knew no other one (or none yet) keeps every slot, as on the embedded store.

Every replica computes the same split from the same list, so the parts are disjoint. It is
a safe split only among replicas that all lost the store; one that still reaches it leases
through it and cannot see the others' local claims (a partial outage is not covered).
"""

from __future__ import annotations

from collections.abc import Sequence


def owns(
    backend: int, slot: int, slot_counts: Sequence[int], replicas: Sequence[str], me: str
) -> bool:
    """Whether replica ``me`` may pin ``slot`` of ``backend`` while the store is down;
    ``slot_counts``: slots per backend, in configuration order; ``replicas``: the live
    replica ids last read from the store."""
    peers = sorted(set(replicas) | {me})
    if len(peers) < 2:
        return True
    position = sum(slot_counts[:backend]) + slot
    return peers[position % len(peers)] == me
