"""Tenant cache isolation: one tenant never reuses another tenant's cached prefix.

A shared KV cache leaks through timing: a cached prompt answers faster, so a tenant could
probe whether another tenant sent a given prompt. With ``isolation.mode: tenant`` every
request belongs to a *tenant*: the hash of its API key (``Authorization: Bearer ...``, or
``X-Api-Key`` when that is absent, as the key check reads it) or of a configured header;
requests without one share the anonymous tenant. Then:

- fingerprints are seeded with the tenant's salt (``salt``), so slot contents, snapshots,
  windows and cache_key affinities of two tenants never match: routing predicts no reuse
  across tenants and the disk tier never restores another tenant's file;
- llama-server itself would still reuse any common prefix it finds in the slot it is given,
  and its host-RAM prompt cache may load another tenant's entry into a pinned slot that
  would lose over half its content, or into an empty one once upstream #28139 is fixed
  (that a pinned empty slot skips the RAM cache is that bug, not a guarantee). So a request may
  reuse a slot's KV (``cache_prompt: true``) only when ``may_reuse``: the slot provably
  holds this tenant's own content and the request keeps at least ``KEEP`` of it (well
  above the server's 0.5 RAM-cache threshold). Otherwise, an empty slot included (which
  has nothing to reuse anyway), it is sent with ``cache_prompt: false``: computed from
  scratch, whatever the server loaded, so its timing says nothing.

Tenant ids are hashes; the key itself is never stored.
"""

from __future__ import annotations

from collections.abc import Mapping

import xxhash

from proxy.core.prompt.fingerprint import Fingerprint, canonical, common_segments
from proxy.core.prompt.headers import header_text

KEEP = 0.6
ANONYMOUS = "anonymous"


def tenant_of(headers: Mapping[str, str], header: str | None) -> str:
    """The tenant id of a request: a hash of its API key (in ``Authorization``, else in
    ``X-Api-Key``, as ``headers.presented_key`` reads it) or of ``header``'s value (a value
    that is not UTF-8 is a 400)."""
    if header is not None:
        value = header_text(headers, header)
    else:
        auth = header_text(headers, "Authorization") or header_text(headers, "X-Api-Key")
        value = auth[7:] if auth[:7].lower() == "bearer " else auth
    if not value:
        return ANONYMOUS
    return xxhash.xxh3_64_hexdigest(value.encode())


def salt(tenant: str | None, lora: object = None) -> int:
    """The seed of a request's hash chain: 0, or salted by its tenant (cache isolation) and by
    the LoRA adapters it asks for. llama-server computes a slot's KV under the request's
    adapters and clears the slot for a request that asks for others, so a slot's content or
    a snapshot is only good for the same adapters."""
    if tenant is None and lora is None:
        return 0
    key = b"tenant\x00" + tenant.encode() if tenant is not None else b""
    if lora is not None:
        key += b"\x00lora\x00" + canonical(lora)
    return int(xxhash.xxh3_64_intdigest(key))


def may_reuse(
    owner: str | None,
    content: Fingerprint | None,
    n_tokens: int,
    fp: Fingerprint,
    tenant: str,
) -> bool:
    """Whether a request of ``tenant`` may reuse the KV of a slot holding ``content``
    (written by ``owner``) without any chance of reusing another tenant's tokens."""
    if content is None or owner != tenant or content.total <= 0 or n_tokens <= 0:
        return False
    kept = fp.tokens_at(common_segments(fp.hashes, content.hashes))
    return kept / content.total >= KEEP
