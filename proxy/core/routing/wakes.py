"""Which releases can change a decision to wait: the keys a waiting request is filed under.

A request whose routing decided to wait (``Reason.WAIT``, step 4 of
``core.routing.decision``) would decide the same again until the fleet changes in a way
that bears on it. The scheduler (``backends.scheduler``) files each waiter under the
*keys* of its decision (``Awaiting``). When a slot frees, it asks only the waiters filed
under one of the *keys of the release* (``release_keys``).
A request waits for busy slot Y (or any slot of a full backend, ``-1``) because Y would
serve it ``predicted`` tokens, at least the bar more than the best idle slot. A freed
slot X changes that only if X, or a RAM entry its backend's server may load into X, or a
snapshot restored into it, serves nearly as much. So:

- ``("slot", b, s)``: the slot it waits for, or ``("slot", b, -1)``: any slot of backend
  ``b``. Any release on ``b`` yields the second. A request is filed under it for the full
  backend it waits for, and for every backend whose RAM cache holds an entry that the server
  could load into a freed slot and that serves it nearly as much (what the entry serves,
  plus the bar, reaches ``predicted``; the RAM views the decision read).
- ``("conversation", a, h)``: its conversation, the chain up to its anchor (``a``
  segments, hash ``h``; ``index.continues``). A freed slot holding that may serve the
  whole prompt. For a prompt without an anchor (a raw prompt), every content sharing its
  head continues it, so the head stands in for it.
- ``("head", i, h)``: its head. A freed slot of another conversation under the same system
  prompt (kin) serves at most the prompt before the anchor (``scoring.kin_reach``). So
  this key is filed only when that, plus the bar the wait cleared (``waiting.wait_bar``),
  could reach ``predicted``. A request whose own slot holds a long conversation is not asked
  when one of the many kin slots of an agent fleet frees.
- ``("saturated", 0, 0)``, ``("pressed", 0, 0)``: the fleet was saturated, or more requests
  waited than slots were idle, when it decided. Either lowers the bar
  (``waiting.wait_bar``). A release after which the fleet is no longer saturated (or
  pressed) yields the key, so every waiter that decided under the lower bar is asked again
  once the bar is back up. That happens once per waiter, because it then decides, and is
  filed, under the bar of the day.
- No key (``None``): any release may change it. That is the case for a hold, a parked
  session spared (``waiting.spare_parked``), a snapshot on disk that could come into any
  freed slot and serve nearly as much (its net reuse, the same bound as the kin), and a
  decision under saturation that left ready backends out (``partial``: a release counts
  saturation over every ready backend, so it could miss the waiter's own view leaving it).

Soundness is property-tested: a waiter filed under none of a release's keys decides to
wait again. A key is what the decision read: a RAM entry parked or a snapshot saved after
it is seen at the waiter's next decision (its own bound on waiting, or a release it is
filed under).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

from proxy.core.disk.snapshots import Offer
from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.routing.scoring import RamViews, RoutingParams, kin_reach
from proxy.core.routing.waiting import Fleetview, saturated, wait_bar

Key = tuple[str, int, int]
SATURATED: Key = ("saturated", 0, 0)
PRESSED: Key = ("pressed", 0, 0)


class Awaiting(NamedTuple):
    """A decision to wait, for the scheduler: the keys of the releases that may change it
    (None: any release). Made while idle slots were held for their sessions (waiting behind
    them, or for something else): when the first hold ends (``until``) and whose it is
    (``held``): the decision may change by itself then, and to the other waiters that slot
    is as if released."""

    keys: frozenset[Key] | None
    until: float | None = None
    held: tuple[int, int] | None = None


def wake_keys(
    fp: Fingerprint,
    wait_for: tuple[int, int],
    predicted: int,
    fleet: Fleetview,
    params: RoutingParams,
    disk: Mapping[int, Offer],
    ram: RamViews,
    partial: bool = False,
) -> frozenset[Key] | None:
    """The keys of a decision to wait for ``wait_for`` (a slot, or ``(b, -1)``), which
    serves ``predicted`` tokens, at least the bar more than the best idle choice
    (``waiting.wait_bar``), given the fleet as it read it and each backend's snapshot offer
    and RAM view of the prompt (module docstring); None when any release may change it.
    ``partial``: the decision left ready backends out (another replica's, or one that
    failed it), so it counts saturation over fewer slots than a release does: then a
    saturated fleet's lower bar is no key a release could be sure to yield."""
    bar = wait_bar(fp, params, fleet, whole_backend=wait_for[1] < 0)
    if fleet.saturated and partial:
        return None
    if any(offer.reuse - offer.cost + bar > predicted for offer in disk.values()):
        return None
    keys: set[Key] = {("slot", *wait_for)}
    if fleet.saturated:
        keys.add(SATURATED)
    if fleet.pressed:
        keys.add(PRESSED)
    for backend in ram.loading:  # a freed slot there may load an entry serving as much
        if ram.most(backend) + bar <= predicted:
            continue  # (its view is not read)
        view = ram[backend]
        if view.loadable and max(view.served[i][0] for i in view.loadable) + bar > predicted:
            keys.add(("slot", backend, -1))
    head, anchor = fp.head, fp.anchor
    if anchor > 0:
        keys.add(("conversation", anchor, fp.hashes[anchor - 1]))
    if head is not None and (anchor == 0 or kin_reach(fp)[0] + bar > predicted):
        keys.add(("head", *head))
    return frozenset(keys)


def release_keys(
    backend: int,
    slot: int,
    content: Fingerprint | None,
    anchors: Collection[int],
    fleet: tuple[int, int, int],
) -> Iterable[Key]:
    """The keys of a release of ``slot`` of ``backend`` that now holds ``content``;
    ``anchors``: the anchors of the waiting prompts' conversation keys (the only positions
    worth reading); ``fleet``: the ready backends' idle slots, their slots, and the requests
    waiting, after the release."""
    idle, slots, waiting = fleet
    if not saturated(idle, slots):
        yield SATURATED
    if idle >= waiting:
        yield PRESSED
    yield "slot", backend, slot
    yield "slot", backend, -1
    if content is None:
        return
    if content.head is not None:
        yield "head", *content.head
    for anchor in anchors:
        if anchor <= len(content.hashes):
            yield "conversation", anchor, content.hashes[anchor - 1]
