"""Redis StateStore (``redis.asyncio``), shared by every proxy replica.

Leases are ``SET key owner NX PX ttl`` (atomic take), renewed by the same owner with a Lua
compare-and-set and released with a Lua compare-and-delete, so one replica can never free
another's lease. Slot records are packed binary values, stamped by a script with the
server's clock (``_PUT_SLOT``); windows are capped lists (``LPUSH``
+ ``LTRIM``); live replicas are one sorted set scored by when each heartbeat expires;
a release is claimed with ``SET NX``; the snapshot index is one hash
(``HMGET``; a change is ``HGET`` then ``HSET``/``HDEL`` under ``WATCH``, retried when another
writer came first). The view a replica reads before routing (leases and slot
records of every slot) is one script (``_VIEW``: each lease, and each record whose stamp —
the last 8 bytes of the packed value — is newer than the one the caller holds, so unchanged
records of long prompts are not sent and parsed again; it was one ``MGET`` of everything).
(Claiming a release as one script instead, semantically the same, replayed worse:
bench/HISTORY.md.) Every redis error
becomes ``StateStoreUnavailable`` here; socket timeouts keep a dead Redis from stalling
requests (the caller then routes on local state, and skips Redis until a ping answers).
They are not *short*: on local state two replicas can pin one slot, so a Redis that is only
slow must not count as down. With 0.25 s, a CPU-starved host (load ~60, or 12 busy loops on
2 cores) timed out opening pool connections and all three replicas of
``test_replicas_never_pin_one_slot_at_once`` fell back at once: a slot pinned twice.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis import asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError, WatchError

from proxy.state import keys
from proxy.state.base import (
    LEFT,
    SNAPSHOT_ATTEMPTS,
    STAMP_BYTES,
    Beat,
    Known,
    SlotRecord,
    SlotRef,
    SlotView,
    StateStoreUnavailable,
    stamp_ms,
)
from proxy.state.replica_scripts import BEAT, LEAVE, NOW, read_beat

_RELEASE = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)
_TAKE = (
    "local v = redis.call('get', KEYS[1]) "
    "if v == false or v == ARGV[1] then redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) "
    "return 1 end return 0"
)


# A record's stamp is its last 8 bytes, little-endian milliseconds (exact in Lua's doubles),
# read alone (``GETRANGE``: a ``GET`` copies the whole record into Lua); -1: no record.
_STAMP = """
local function stamp(key)
  local s = redis.call('getrange', key, -8, -1)
  if s == '' then return -1 end
  local t = 0
  for j = 8, 1, -1 do t = t * 256 + string.byte(s, j) end
  return t
end
"""
# KEYS: n leases, then the n slots' records; ARGV[i]: the stamp of record i the caller holds
# (-1: none). Returns the n owners, the n records (nil when not newer than the caller's), then
# the server's time ("seconds.micros"), which the stamps are in.
_VIEW = (
    _STAMP
    + """
local n = #KEYS / 2
local out = {}
for i = 1, n do out[i] = redis.call('get', KEYS[i]) end
for i = 1, n do
  local v = false
  if stamp(KEYS[n + i]) > tonumber(ARGV[i]) then v = redis.call('get', KEYS[n + i]) end
  out[n + i] = v
end
local t = redis.call('TIME')
out[2 * n + 1] = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
return out
"""
)
_RENEW = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
)
# Times replicas compare are the server's (``NOW``, ``proxy.state.replica_scripts``).
# KEYS: the release keys of its hashes; ARGV: release id, TTL (ms). Value: "id|when".
_PUT_RELEASE = NOW + (
    "local v = ARGV[1] .. '|' .. string.format('%.6f', now) "
    "for i = 1, #KEYS do redis.call('set', KEYS[i], v, 'PX', ARGV[2]) end return #KEYS"
)
# KEYS: the release keys of a prompt's hashes, oldest first; ARGV: the claimed marks' key
# prefix, their TTL (ms). Claims the newest unclaimed release: {id, seconds since it was put}
# (a string: a Lua number returned to Redis is cut to an integer), or nil.
_CLAIM = NOW + (
    "for i = #KEYS, 1, -1 do "
    "  local v = redis.call('get', KEYS[i]) "
    "  if v then "
    "    local id, at = string.match(v, '^(.*)|([^|]*)$') "
    "    if redis.call('set', ARGV[1] .. id, 1, 'NX', 'PX', ARGV[2]) then "
    "      return {id, string.format('%.6f', now - tonumber(at))} "
    "    end "
    "  end "
    "end "
    "return false"
)
# KEYS[1]: a slot's record; ARGV: the packed record without its stamp, TTL (ms). Stamps it
# with the server's time in ms, later than the record it replaces; returns the stamp.
_PUT_SLOT = (
    NOW
    + _STAMP
    + """
local ms = math.floor(now * 1000 + 0.5)
local before = stamp(KEYS[1])
if before >= ms then ms = before + 1 end
local b, x = {}, ms
for j = 1, 8 do b[j] = x % 256; x = math.floor(x / 256) end
redis.call('set', KEYS[1], ARGV[1] .. string.char(unpack(b)), 'PX', ARGV[2])
return ms
"""
)
T = TypeVar("T")


async def _call(operation: Awaitable[T]) -> T:
    """Await a redis call; any redis error becomes ``StateStoreUnavailable``."""
    try:
        return await operation
    except RedisError as exc:
        raise StateStoreUnavailable(str(exc)) from None


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _record(value: bytes | str | None) -> SlotRecord | None:
    """A slot record as read, or None: none there, or bytes that are not one (ignored)."""
    try:
        return None if value is None else SlotRecord.unpack(_bytes(value))
    except ValueError:
        return None


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisStateStore:
    def __init__(self, url: str, *, timeout: float = 1.0, connect_timeout: float = 2.0) -> None:
        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=connect_timeout,
            retry_on_timeout=False,
        )
        self._take = self._redis.register_script(_TAKE)
        self._release = self._redis.register_script(_RELEASE)
        self._renew = self._redis.register_script(_RENEW)
        self._view = self._redis.register_script(_VIEW)
        self._beat = self._redis.register_script(BEAT)
        self._leave = self._redis.register_script(LEAVE)
        self._put_release = self._redis.register_script(_PUT_RELEASE)
        self._claim = self._redis.register_script(_CLAIM)
        self._put_slot = self._redis.register_script(_PUT_SLOT)

    async def get_affinity(self, key: str, now: float) -> SlotRef | None:
        raw = await _call(self._redis.get(keys.affinity(key)))
        if raw is None:
            return None
        try:  # (another writer's bytes are no affinity: ignored, as an absent one)
            backend, _, slot = _bytes(raw).decode().rpartition("|")
            return (backend, int(slot))
        except ValueError:  # (UnicodeDecodeError is one)
            return None

    async def set_affinity(self, key: str, ref: SlotRef, ttl: float, now: float) -> None:
        await _call(self._redis.set(keys.affinity(key), f"{ref[0]}|{ref[1]}", px=_ms(ttl)))

    async def acquire_lease(self, ref: SlotRef, owner: str, ttl: float, now: float) -> bool:
        return bool(await _call(self._take(keys=[keys.lease(*ref)], args=[owner, _ms(ttl)])))

    async def release_lease(self, ref: SlotRef, owner: str) -> None:
        await _call(self._release(keys=[keys.lease(*ref)], args=[owner]))

    async def renew_lease(self, ref: SlotRef, owner: str, ttl: float, now: float) -> bool:
        return bool(await _call(self._renew(keys=[keys.lease(*ref)], args=[owner, _ms(ttl)])))

    async def view(
        self, refs: Sequence[SlotRef], now: float, known: Known | None = None
    ) -> SlotView:
        if not refs:
            return SlotView({}, {})
        names = [keys.lease(*ref) for ref in refs] + [keys.slot(*ref) for ref in refs]
        have = known or {}
        stamps = [stamp_ms(have[ref]) if ref in have else -1 for ref in refs]
        values = await _call(self._view(keys=names, args=stamps))
        owners = dict(zip(refs, values[: len(refs)], strict=True))
        records = dict(zip(refs, values[len(refs) : 2 * len(refs)], strict=True))
        return SlotView(
            {ref: _bytes(v).decode(errors="replace") for ref, v in owners.items() if v is not None},
            {ref: r for ref, v in records.items() if (r := _record(v)) is not None},
            float(_bytes(values[-1])),
        )

    async def put_slot(self, ref: SlotRef, record: SlotRecord, ttl: float, now: float) -> float:
        body = record.pack()[:-STAMP_BYTES]
        stamp = await _call(self._put_slot(keys=[keys.slot(*ref)], args=[body, _ms(ttl)]))
        return int(stamp) / 1000

    async def clear_slots(self, refs: Sequence[SlotRef]) -> None:
        if not refs:
            return
        await _call(self._redis.delete(*(keys.slot(*ref) for ref in refs)))

    async def _pipeline(self, build: Callable[[Pipeline], object], atomic: bool = True) -> Any:
        """Queue commands with ``build`` and run them in one round trip; the pipeline's own
        context can raise too, so the whole of it maps redis errors."""
        try:
            async with self._redis.pipeline(transaction=atomic) as pipe:
                build(pipe)
                return await pipe.execute()
        except RedisError as exc:
            raise StateStoreUnavailable(str(exc)) from None

    async def heartbeat(
        self,
        owner: str,
        ttl: float,
        now: float,
        expires: float | None = None,
        previous: str | None = None,
    ) -> Beat:
        args: list[str | float] = [owner, ttl, _ms(ttl), "" if expires is None else expires]
        args.append(previous or "")
        return read_beat(await _call(self._beat(keys=[keys.REPLICAS], args=args)))

    async def leave(
        self,
        owner: str,
        ttl: float,
        now: float,
        mark: str | None = None,
        expires: float | None = None,
    ) -> None:
        left = owner + LEFT if mark is None else mark
        args: list[str | float] = [left, ttl, _ms(ttl), "" if expires is None else expires, owner]
        await _call(self._leave(keys=[keys.REPLICAS], args=args))

    async def push_window(
        self, name: str, entry: bytes, limit: int, ttl: float, now: float
    ) -> None:
        key = keys.window(name)

        def build(pipe: Pipeline) -> None:
            pipe.lpush(key, entry)
            pipe.ltrim(key, 0, limit - 1)
            pipe.pexpire(key, _ms(ttl))

        await self._pipeline(build)

    async def window(self, name: str, now: float) -> list[bytes]:
        values = await _call(self._redis.lrange(keys.window(name), 0, -1))
        return [_bytes(v) for v in values]

    async def put_release(
        self, release: str, hashes: Sequence[int], ttl: float, now: float
    ) -> None:
        if hashes:
            names = [keys.release(k) for k in hashes]
            await _call(self._put_release(keys=names, args=[release, _ms(ttl)]))

    async def claim_release(
        self, hashes: Sequence[int], ttl: float, now: float
    ) -> tuple[str, float] | None:
        if not hashes:
            return None
        names = [keys.release(k) for k in hashes]
        found = await _call(self._claim(keys=names, args=[keys.claimed(""), _ms(ttl)]))
        if not found:
            return None
        try:
            release, age = (_bytes(v).decode() for v in found)
            return release, float(age)
        except ValueError:  # (not a release this proxy put: none)
            return None

    async def claimed(self, releases: Sequence[str], now: float) -> set[str]:
        if not releases:
            return set()
        values = await _call(self._redis.mget([keys.claimed(r) for r in releases]))
        return {r for r, v in zip(releases, values, strict=True) if v is not None}

    async def get_snapshots(self, keys_: Sequence[str]) -> dict[str, bytes]:
        if not keys_:
            return {}
        values = await _call(self._redis.hmget(keys.SNAPSHOTS, list(keys_)))
        return {k: _bytes(v) for k, v in zip(keys_, values, strict=True) if v is not None}

    async def update_snapshots(
        self, key: str, change: Callable[[bytes | None], bytes | None]
    ) -> bool:
        """``change`` under ``WATCH`` of the index: a write of any other replica or backend
        between the read and ours aborts ours, and ``change`` runs again on what it wrote."""
        for _ in range(SNAPSHOT_ATTEMPTS):
            if await _call(self._update_snapshots(key, change)):
                return True
        return False

    async def _update_snapshots(
        self, key: str, change: Callable[[bytes | None], bytes | None]
    ) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            await pipe.watch(keys.SNAPSHOTS)
            current = await pipe.hget(keys.SNAPSHOTS, key)
            old = None if current is None else _bytes(current)
            value = change(old)
            if value == old:
                return True  # nothing to write
            pipe.multi()  # type: ignore[no-untyped-call]
            if value is None:
                pipe.hdel(keys.SNAPSHOTS, key)
            else:
                pipe.hset(keys.SNAPSHOTS, key, value)
            try:
                await pipe.execute()
            except WatchError:
                return False  # another writer came first: the caller tries again
            return True

    async def all_snapshots(self) -> dict[str, bytes]:
        found = await _call(self._redis.hgetall(keys.SNAPSHOTS))
        out = {}
        for k, v in found.items():
            try:
                out[_bytes(k).decode()] = _bytes(v)
            except UnicodeDecodeError:
                continue  # (no field this proxy writes: another writer's, ignored)
        return out

    async def ping(self) -> None:
        """Whether Redis answers again after an outage: on fresh connections (pooled ones
        opened before a Redis restart would each fail once, a flap back into the outage)."""
        await _call(self._redis.connection_pool.disconnect(inuse_connections=False))
        await _call(self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()
