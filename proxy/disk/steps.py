"""The disk tier's slot operations: park, restore, scoped save (once per prefix at a time:
``save_once``), whole-slot save.

Each runs while the proxy holds the slot (claimed and leased, nothing of a client's in
flight on it) and talks to llama-server only through ``upstream``. None raises: a failure is
logged, counted, and leaves the fleet's picture of the slot true (a failed restore wipes the
slot in llama-server, so the slot is then marked empty).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from math import ceil
from typing import Any

from proxy.core.disk.quota import WriteQuota
from proxy.core.disk.snapshots import Layout, Offer, Snapshot, file_name
from proxy.core.prompt.fingerprint import Fingerprint, common_segments
from proxy.core.prompt.isolation import may_reuse
from proxy.core.server.ram_cache import held, needs_park
from proxy.disk.plan import DiskPlan, Tier
from proxy.metrics import ProxyMetrics
from proxy.upstream import LlamaServerClient, SlotActionFailed

log = logging.getLogger(__name__)
SAFE_BOUNDARY_TRIES = 3  # boundaries stepped down when a template rewrites earlier turns
LOOKAHEAD_CHARS = 256  # text after a boundary tokenized with it to check the cut is clean
UNCAPPED = WriteQuota(limit=0, window=1.0)


class DiskSteps:
    def __init__(self, client: LlamaServerClient, tier: Tier, metrics: ProxyMetrics) -> None:
        self._client = client
        self._tier = tier
        self._metrics = metrics
        self._saving: dict[tuple[str, int], asyncio.Future[None]] = {}  # scoped saves in flight
        self._bytes_per_token: dict[str, float] = {}  # layout's model id -> of its last save

    def _url(self, index: int) -> str:
        return self._tier.settings.backends[index].base_url

    def _unsupported(self, index: int, exc: SlotActionFailed) -> None:
        if " 501 " in str(exc):
            log.warning("[disk-cache] backend %d has no --slot-save-path: disk tier off", index)
            self._tier.backends[index].supported = False

    async def save_slot(
        self,
        dp: DiskPlan,
        content: Fingerprint,
        segments: int,
        index: int,
        slot: int,
        layout: Layout,
        kind: str,
        held: int = 0,
    ) -> Snapshot | None:
        """Save the slot as it is now, indexed as the first ``segments`` of ``content``;
        ``held``: the estimated tokens the slot holds when that is more (a slot holding the
        prefix and more: what a restore of the file loads, of which a request reuses the
        prefix)."""
        if segments == 0 or content.tokens_at(segments) < self._tier.settings.disk.min_tokens:
            return None
        chain = content.hashes[segments - 1]
        if any(s.directory == self._tier.directory(index) for s in dp.lookup_chain(chain)):
            return None  # already on disk
        # a park saves another session, not this client's request: it is not charged
        quota = UNCAPPED if kind == "park" else self._tier.quota
        estimate = self._estimate(layout, content, segments)
        key = quota.reserve(dp.client, estimate, self._tier.now())
        if key is None:
            log.info("[disk-cache] %s save skipped: the client is over its write cap", kind)
            self._metrics.disk_events.labels("capped").inc()
            return None
        snapshot = None
        try:
            snapshot = await self._save(dp, content, segments, index, slot, layout, kind, held)
        finally:  # the reservation becomes what was written
            written = snapshot.nbytes if snapshot is not None else 0
            quota.settle(key, estimate, written, self._tier.now())
        if snapshot is not None:
            await self._tier.index.enforce_budget(snapshot.directory)
        return snapshot

    def _estimate(self, layout: Layout, content: Fingerprint, segments: int) -> int:
        """A save's size reserved against the write cap: from the bytes per token of the
        layout's last save, or the whole cap while unknown."""
        per_token = self._bytes_per_token.get(layout.model_id)
        if per_token is None:
            return self._tier.quota.limit
        return ceil(per_token * content.tokens_at(segments))

    async def _save(
        self,
        dp: DiskPlan,
        content: Fingerprint,
        segments: int,
        index: int,
        slot: int,
        layout: Layout,
        kind: str,
        held: int = 0,
    ) -> Snapshot | None:
        chain = content.hashes[segments - 1]
        try:
            answer = await self._client.slot_action(
                self._url(index), slot, "save", file_name(layout, chain)
            )
        except SlotActionFailed as exc:
            log.warning("[disk-cache] %s save on slot %d failed: %s", kind, slot, exc)
            self._unsupported(index, exc)
            return None
        whole = kind != "scoped"  # the slot as it is: prompt and reply
        snapshot = self._snapshot(layout, index, content, segments, answer, whole)
        if held > snapshot.estimate:
            snapshot = replace(snapshot, estimate=held)
        expected = self._tier.fleet.backends[index].from_estimate(snapshot.estimate)
        if snapshot.tokens * 2 < expected:
            # the server's slot held far less than the proxy knew (it lost the content
            # unseen): not a snapshot of that prefix (its file, unlisted, goes with the budget)
            log.warning(
                "[disk-cache] %s save on slot %d held %d tokens of %d expected: not kept",
                kind,
                slot,
                snapshot.tokens,
                expected,
            )
            return None
        if snapshot.estimate > 0:
            self._bytes_per_token[layout.model_id] = snapshot.nbytes / snapshot.estimate
        await self._tier.index.put(snapshot)
        dp.saved[chain] = snapshot
        self._metrics.disk_events.labels("save").inc()
        self._metrics.disk_saves.labels(kind).inc()
        log.info(
            "[disk-cache] %s save: %d tokens, %d bytes -> %s",
            kind,
            snapshot.tokens,
            snapshot.nbytes,
            snapshot.name,
        )
        return snapshot

    async def park(
        self,
        dp: DiskPlan,
        fp: Fingerprint,
        index: int,
        slot_id: int,
        layout: Layout,
        primed: bool = False,
    ) -> None:
        """Save another conversation's long, recently used content before it is overwritten
        where the server will not bring it back itself (``ram_cache.needs_park``): not when its
        RAM cache will hold it where a primer brings it back (an idle save left a copy there),
        nor once a primer reached the slot (``primed``: its hook parked the content, and the
        slot holds the primer: ``DiskTier.before`` parks first where ``park: on`` asks)."""
        disk = self._tier.settings.disk
        backend = self._tier.fleet.backends[index]
        slot = backend.slots[slot_id]
        content = slot.content
        if disk.park == "off" or primed or content is None or content.total < disk.park_min_tokens:
            return
        length = backend.kv_estimate(content, slot.n_tokens)
        # (a copy under a RAM budget may be pushed out before its session is back)
        primes = self._tier.fleet.primes and backend.primable
        copied = primes and backend.ram_tokens is None and held(backend.ram_entries, content)
        if not needs_park(content, fp, length, backend.ram, disk.park == "on", copied):
            return
        half_life = self._tier.settings.routing.value_half_life_seconds
        if self._tier.now() - slot.last_used > half_life:
            return  # not recently active: not worth a file
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tier.parking.append((content, done))  # its session may be back meanwhile
        try:
            found = await self._tier.index.find(content, [layout.model_id], content.total)
            dp.found.extend(e for entries in found.values() for e in entries)
            await self.save_slot(dp, content, len(content.hashes), index, slot_id, layout, "park")
        finally:
            self._tier.parking = [p for p in self._tier.parking if p[1] is not done]
            done.set_result(None)

    async def restore(self, dp: DiskPlan, offer: Offer, index: int, slot_id: int) -> None:
        snapshot = offer.snapshot
        exists = await self._tier.index.file_exists(snapshot)
        slot = self._tier.fleet.backends[index].slots[slot_id]
        if exists is False:
            log.warning("[disk-cache] %s is gone from disk: forgotten", snapshot.name)
            await self._tier.index.forget(snapshot)
            return
        try:
            answer = await self._client.slot_action(
                self._url(index), slot_id, "restore", snapshot.name
            )
        except SlotActionFailed as exc:
            # llama-server wipes the slot on any failed restore
            slot.content, slot.n_tokens = None, 0
            self._metrics.disk_refusals.labels("failed").inc()
            self._metrics.disk_events.labels("refusal").inc()
            log.warning("[disk-cache] restore of %s failed: %s", snapshot.name, exc)
            self._unsupported(index, exc)
            await self._tier.index.update(replace(snapshot, bad=True))
            return
        restored = int(answer.get("n_restored", 0))
        if not restored:  # a file holding nothing: judged bad, as a refused restore
            slot.content, slot.n_tokens = None, 0
            log.warning("[disk-cache] %s restored no token: marked bad", snapshot.name)
            await self._tier.index.update(replace(snapshot, bad=True))
            return
        timings = answer.get("timings") or {}
        self._tier.learn_restore(
            index, int(answer.get("n_read", 0)), float(timings.get("restore_ms", 0))
        )
        slot.content, slot.n_tokens = dp.fp.prefix(offer.segments), restored
        slot.owner = dp.tenant
        # the request is known to share only the matched part of the file (an alias match
        # of a whole-slot snapshot): that part, in the file's tokens, is what must be reused
        share = min(1.0, offer.reuse / snapshot.estimate) if snapshot.estimate else 1.0
        dp.restored, dp.restored_tokens = snapshot, round(restored * share)
        self._metrics.disk_events.labels("restore").inc()
        self._metrics.disk_restored_tokens.inc(restored)
        log.info(
            "[disk-cache] restored %d tokens from %s into slot %d", restored, snapshot.name, slot_id
        )

    async def save_once(
        self,
        dp: DiskPlan,
        segments: int,
        index: int,
        slot_id: int,
        save: Callable[[], Awaitable[None]],
    ) -> None:
        """``save`` (a scoped save of the request's first ``segments``), unless another request
        is saving the same prefix into the same directory: then wait for that save (bounded)
        and restore its snapshot into this slot rather than prefill the prefix a second time
        (new sessions arriving together with one system prompt would each prefill and save it
        at once)."""
        key = (self._tier.directory(index), dp.fp.hashes[segments - 1])
        other = self._saving.get(key)
        if other is None:
            self._saving[key] = done = asyncio.get_running_loop().create_future()
            try:
                await save()
            finally:
                del self._saving[key]
                done.set_result(None)
            return
        await asyncio.wait([other], timeout=self._tier.settings.routing.max_slot_wait_seconds)
        dp.lookup = await self._tier.lookup(dp.fp, dp.tenant)
        offer = dp.lookup.offers.get(index)
        content = self._tier.fleet.backends[index].slots[slot_id].content
        held = common_segments(dp.fp.hashes, content.hashes) if content is not None else 0
        if offer is not None and offer.segments > held:  # the slot does not hold it already
            self._metrics.disk_events.labels("shared").inc()
            await self.restore(dp, offer, index, slot_id)
            dp.filled = True

    async def scoped_save(
        self,
        dp: DiskPlan,
        fp: Fingerprint,
        segments: int,
        index: int,
        slot_id: int,
        body: dict[str, Any],
        layout: Layout,
    ) -> None:
        """Prefill exactly the selected prefix (stepping down to a safe boundary), save it.
        When another idle slot of the backend holds the prefix (another session under the
        same system prompt), that slot is saved instead and restored into this one: no token
        is computed (``_copy``)."""
        messages = body.get("messages")
        chain = fp.hashes[segments - 1]
        mine = self._tier.directory(index)
        if not isinstance(messages, list) or any(
            s.directory == mine for s in dp.lookup_chain(chain)
        ):
            return  # not a chat body, or this prefix is on disk already
        if await self._copy(dp, fp, segments, index, slot_id, layout):
            return
        url = self._url(index)
        try:
            full = await self._client.render(url, body, generation=True)
            for k in range(segments, max(1, segments - SAFE_BOUNDARY_TRIES), -1):
                prefix = await self._client.render(
                    url, {**body, "messages": messages[: k - 1]}, generation=False
                )
                if not full.startswith(prefix) or len(prefix) >= len(full):
                    log.debug("[disk-cache] boundary %d is not safe (rendering)", k)
                    continue  # the template renders earlier turns differently later on
                # BPE merges are local: the prefix's tokens must start the tokens of the
                # prefix followed by what comes next
                ids = await self._client.tokenize(url, prefix)
                ahead = await self._client.tokenize(url, full[: len(prefix) + LOOKAHEAD_CHARS])
                if ids != ahead[: len(ids)] or len(ids) >= len(ahead):
                    log.debug("[disk-cache] boundary %d is not safe (tokens)", k)
                    continue
                if dp.scope.tokens and len(ids) > dp.scope.tokens:
                    continue  # fixed N: align down
                if len(ids) < self._tier.settings.disk.min_tokens:
                    log.debug("[disk-cache] prefix of %d tokens: under the minimum", len(ids))
                    return
                slot = self._tier.fleet.backends[index].slots[slot_id]
                reuse = dp.tenant is None or may_reuse(
                    slot.owner, slot.content, slot.n_tokens, fp, dp.tenant
                )
                answer = await self._client.warm(url, ids, slot_id, reuse, body.get("lora"))
                timings = answer.get("timings") or {}
                self._warmed(dp, index, timings)
                await self._tier.judge_restore(dp, int(timings.get("cache_n", 0)), len(ids))
                slot.content, slot.n_tokens = fp.prefix(k), len(ids)
                slot.owner = dp.tenant
                await self.save_slot(dp, fp, k, index, slot_id, layout, "scoped")
                return
        except SlotActionFailed as exc:
            log.warning("[disk-cache] scoped save skipped: %s", exc)
            self._unsupported(index, exc)

    async def _copy(
        self,
        dp: DiskPlan,
        fp: Fingerprint,
        segments: int,
        index: int,
        slot_id: int,
        layout: Layout,
    ) -> bool:
        """Save an idle slot of the backend that holds the request's first ``segments`` (the
        most recently used of them) as their snapshot, and restore it into ``slot_id``:
        llama-server copies a slot's KV only through a file, which costs its bytes' write
        and read where a warm-up computes every token. The file holds the source's whole KV;
        the request reuses the prefix of it and overwrites the rest. False when no slot holds
        the prefix, or the save failed (the caller warms the slot up instead)."""
        backend = self._tier.fleet.backends[index]
        sources = [
            s
            for s in backend.idle_slots()
            if s.id != slot_id
            and s.content is not None
            and s.n_tokens > 0
            and common_segments(s.content.hashes, fp.hashes) >= segments
            and (dp.tenant is None or may_reuse(s.owner, s.content, s.n_tokens, fp, dp.tenant))
        ]
        if not sources:
            return False
        source = max(sources, key=lambda s: s.last_used)
        assert source.content is not None
        held = backend.kv_estimate(source.content, source.n_tokens)
        snapshot = await self.save_slot(dp, fp, segments, index, source.id, layout, "scoped", held)
        if snapshot is None:
            return False
        log.info("[disk-cache] prefix copied from slot %d for slot %d", source.id, slot_id)
        reuse = min(fp.tokens_at(segments), fp.total - 1)
        await self.restore(dp, Offer(snapshot, reuse, 0.0, segments), index, slot_id)
        dp.filled = True
        return True

    def _warmed(self, dp: DiskPlan, index: int, timings: dict[str, Any]) -> None:
        """The warm-up's prefill is the request's: the tokens it computed are no cache hit of
        the request's, and its seconds are prefill seconds (``metrics``)."""
        computed, ms = timings.get("prompt_n"), timings.get("prompt_ms")
        dp.filled = True
        dp.warmed += computed if isinstance(computed, int) and computed > 0 else 0
        if isinstance(ms, int | float) and ms > 0:
            label = self._tier.fleet.backends[index].label
            self._metrics.prefill_seconds.labels(label).inc(ms / 1000)

    def _snapshot(
        self,
        layout: Layout,
        index: int,
        content: Fingerprint,
        segments: int,
        answer: dict[str, Any],
        whole: bool,
    ) -> Snapshot:
        now = self._tier.wall()
        chain = content.hashes[segments - 1]
        shorter = {segments - 1, segments - 2, content.anchor} if whole else set()
        aliases = tuple(content.hashes[k - 1] for k in sorted(shorter) if 0 < k < segments)
        return Snapshot(
            name=file_name(layout, chain),
            directory=self._tier.directory(index),
            chain=chain,
            segments=segments,
            tokens=int(answer.get("n_saved", 0)),
            estimate=content.tokens_at(segments),
            nbytes=int(answer.get("n_written", 0)),
            layout=layout,
            created=now,
            last_used=now,
            aliases=aliases,
        )
