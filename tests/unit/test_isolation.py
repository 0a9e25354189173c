from __future__ import annotations

from proxy.core.prompt.fingerprint import Fingerprint, fingerprint_chat
from proxy.core.prompt.isolation import ANONYMOUS, may_reuse, salt, tenant_of


def words(text: str) -> int:
    return len(text.split())


BODY = {
    "messages": [{"role": "system", "content": "rules " * 50}, {"role": "user", "content": "q"}]
}


def test_tenant_is_a_hash_of_the_key_or_the_header() -> None:
    a = tenant_of({"Authorization": "Bearer key-a"}, None)
    assert a == tenant_of({"Authorization": "bearer key-a"}, None)
    assert a != tenant_of({"Authorization": "Bearer key-b"}, None)
    # a key sent in X-Api-Key (the Anthropic SDK's header) is the same tenant's, not anonymous
    assert a == tenant_of({"X-Api-Key": "key-a"}, None)
    assert tenant_of({"X-Api-Key": "key-b"}, None) not in (a, ANONYMOUS)
    assert a == tenant_of({"Authorization": "Bearer key-a", "X-Api-Key": "key-b"}, None)
    assert "key-a" not in a
    assert tenant_of({}, None) == ANONYMOUS
    assert tenant_of({"X-Team": "t1"}, "X-Team") != tenant_of({"X-Team": "t2"}, "X-Team")
    assert tenant_of({"Authorization": "Bearer k"}, "X-Team") == ANONYMOUS


def test_salted_fingerprints_never_match_across_tenants() -> None:
    a = fingerprint_chat(BODY, words, salt("a"))
    b = fingerprint_chat(BODY, words, salt("b"))
    assert a.tokens == b.tokens
    assert not set(a.hashes) & set(b.hashes)
    assert fingerprint_chat(BODY, words, salt("a")) == a


def test_may_reuse_only_own_content_kept_mostly() -> None:
    fp = fingerprint_chat(BODY, words, salt("a"))
    prefix = Fingerprint(fp.hashes[:2], fp.tokens[:2], fp.anchor)
    assert may_reuse("a", prefix, 60, fp, "a")  # own content, all of it kept
    assert not may_reuse("b", prefix, 60, fp, "a")  # another tenant's KV
    assert not may_reuse(None, prefix, 60, fp, "a")  # unknown writer
    # empty: nothing to reuse, and a fixed server (upstream #28139) would load its RAM cache
    assert not may_reuse(None, None, 0, fp, "a")
    assert not may_reuse("a", None, 0, fp, "a")
    assert not may_reuse("a", None, 60, fp, "a")  # KV of unknown content
    other = fingerprint_chat(
        {"messages": [{"role": "user", "content": "x " * 500}]}, words, salt("a")
    )
    assert not may_reuse("a", other, 500, fp, "a")  # would lose over 40 %: RAM cache may load
