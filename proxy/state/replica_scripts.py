"""The Redis scripts that keep the list of live replicas, and the server-clock preamble the
Redis store's scripts share.

Live replicas are one sorted set, each entry scored by when it lapses on the server's clock
(``redis.call('TIME')``), not the callers': their machines' clocks may differ (see
``proxy.state.base``). A heartbeat adds or refreshes its entry, scored ``now + ttl`` or the
expiry the caller gives if that is sooner (a signed entry names its expiry:
``core.replicas.auth``), removes the entry it replaces and every lapsed one, and returns the
server's time with each live entry and its score: whoever writes to Redis can write any
entry and any score, so the reader judges them (``proxy.replicas.shared_state``).
"""

from __future__ import annotations

from typing import Any

from proxy.state.base import Beat

# (``replicate_commands``: writes after TIME are allowed before Redis 7 too; a no-op since,
# and called only where it exists.)
NOW = (
    "if redis.replicate_commands then redis.replicate_commands() end "
    "local t = redis.call('TIME') local now = tonumber(t[1]) + tonumber(t[2]) / 1000000 "
)
# ARGV[2]: TTL (s), ARGV[4]: the latest expiry the caller allows, or ''.
_SCORE = (
    "local score = now + tonumber(ARGV[2]) "
    "if ARGV[4] ~= '' then score = math.min(score, tonumber(ARGV[4])) end "
)
# The replicas' set lives as long as its longest-lived entry (a shorter TTL never cuts it).
_KEEP = (
    "if redis.call('pttl', KEYS[1]) < tonumber(ARGV[3]) then "
    "redis.call('pexpire', KEYS[1], ARGV[3]) end "
)
# KEYS[1]: the replicas' set; ARGV: entry, TTL (s), key TTL (ms), expiry or '', the entry it
# replaces or ''. Returns the server's time and the live entries, each followed by its score.
BEAT = (
    NOW
    + _SCORE
    + "if ARGV[5] ~= '' and ARGV[5] ~= ARGV[1] then redis.call('zrem', KEYS[1], ARGV[5]) end "
    "redis.call('zadd', KEYS[1], score, ARGV[1]) "
    "redis.call('zremrangebyscore', KEYS[1], '-inf', now) "
    + _KEEP
    + "local s = string.format('%.6f', now) "
    "return {s, redis.call('zrangebyscore', KEYS[1], '(' .. s, '+inf', 'WITHSCORES')}"
)
# KEYS[1]: the replicas' set; ARGV: the left mark, TTL (s), key TTL (ms), expiry or '', the
# entry it replaces.
LEAVE = (
    NOW + _SCORE + "redis.call('zrem', KEYS[1], ARGV[5]) "
    "redis.call('zadd', KEYS[1], score, ARGV[1]) " + _KEEP + "return 1"
)


def _text(value: Any) -> str:
    """An entry as text (any bytes a writer put there: undecodable ones are replaced)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def read_beat(found: Any) -> Beat:
    """``BEAT``'s reply as a ``Beat``, sorted by entry."""
    now, flat = found
    pairs = zip(flat[0::2], flat[1::2], strict=True)
    return Beat(float(_text(now)), sorted((_text(e), float(_text(s))) for e, s in pairs))
