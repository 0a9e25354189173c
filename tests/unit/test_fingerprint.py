from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.prompt.fingerprint import (
    MESSAGE_OVERHEAD,
    PART_BYTES,
    Fingerprint,
    common_segments,
    fingerprint_chat,
    message_segment,
    reply_segment,
    shared_tokens,
)
from proxy.core.prompt.raw_blocks import (
    CHUNK_CHARS,
    Blocks,
    fingerprint_raw,
    fingerprint_text,
    fingerprint_tokens,
    paragraphs,
    token_blocks,
)
from proxy.routing.tokenizer import TokenCounter


def words(text: str) -> int:
    return len(text.split())


SYSTEM = {"role": "system", "content": "You are helpful. " * 10}
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]


def body(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [SYSTEM, *messages], **extra}


def test_next_turn_shares_every_segment_up_to_the_new_message() -> None:
    turn1 = body({"role": "user", "content": "list files"})
    turn2 = body(
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "a b c"},
        {"role": "user", "content": "thanks"},
    )
    a, b = fingerprint_chat(turn1, words), fingerprint_chat(turn2, words)
    assert common_segments(a.hashes, b.hashes) == len(a.hashes) == 3
    assert b.tokens_at(3) == a.total


def test_reply_extends_the_chain_as_the_client_sends_it_back() -> None:
    turn1 = body({"role": "user", "content": "hi"})
    slot = fingerprint_chat(turn1, words).extend([reply_segment("hello there", None)], words)
    turn2 = body(
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "more"},
    )
    assert common_segments(slot.hashes, fingerprint_chat(turn2, words).hashes) == 4


def test_tool_call_reply_with_null_content_matches() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]
    slot = fingerprint_chat(body(), words).extend([reply_segment("", calls)], words)
    sent = body({"role": "assistant", "content": None, "tool_calls": calls})
    assert common_segments(slot.hashes, fingerprint_chat(sent, words).hashes) == 3


def test_tools_and_template_kwargs_are_part_of_the_prefix() -> None:
    plain = fingerprint_chat(body({"role": "user", "content": "x"}), words)
    tooled = fingerprint_chat(body({"role": "user", "content": "x"}, tools=TOOLS), words)
    kwargs = fingerprint_chat(
        body({"role": "user", "content": "x"}, chat_template_kwargs={"enable_thinking": False}),
        words,
    )
    assert common_segments(plain.hashes, tooled.hashes) == 0
    assert common_segments(plain.hashes, kwargs.hashes) == 0
    assert tooled.tokens[0] > 0


def test_openclaw_carrier_message_only_costs_the_tail() -> None:
    carrier = {"role": "user", "content": [{"type": "text", "text": "<<<CTX>>> none"}]}
    turn1 = body({"role": "user", "content": "q1"}, carrier)
    turn2 = body(
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        carrier,
    )
    a, b = fingerprint_chat(turn1, words), fingerprint_chat(turn2, words)
    assert common_segments(a.hashes, b.hashes) == 3  # preamble, system, q1


def test_token_counts_are_cumulative_with_template_overhead() -> None:
    fp = fingerprint_chat(body({"role": "user", "content": "one two three"}), words)
    assert fp.tokens[0] == 0  # empty preamble
    assert fp.tokens[2] - fp.tokens[1] == words("userone two three") + MESSAGE_OVERHEAD


def test_responses_input_string_is_one_user_message() -> None:
    fp = fingerprint_chat({"input": "hello world", "instructions": "be brief"}, words)
    assert len(fp.hashes) == 2
    assert fp.tokens[0] == words("be brief") + MESSAGE_OVERHEAD


def test_token_blocks() -> None:
    fp = fingerprint_tokens(list(range(10)), block_tokens=4)
    assert fp.tokens == (4, 8, 10)
    longer = fingerprint_tokens([*range(10), 99], block_tokens=4)
    assert common_segments(fp.hashes, longer.hashes) == 2


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40), st.integers(4, 9))
def test_token_blocks_hash_each_id_as_4_little_endian_bytes(ids: list[int], block: int) -> None:
    """The ids are packed in one call now; the hashes stay those of the per-id encoding (Redis
    records and disk snapshot indexes written before keep matching)."""
    import xxhash

    hashes, previous = [], 7
    for start in range(0, len(ids), block):
        key = b"".join(i.to_bytes(4, "little", signed=True) for i in ids[start : start + block])
        previous = xxhash.xxh3_64_intdigest(key, seed=previous)
        hashes.append(previous)
    fp = fingerprint_tokens(ids, block, seed=7)
    assert fp.hashes == tuple(hashes)
    assert fp.tokens == tuple(min(len(ids), start + block) for start in range(0, len(ids), block))


@given(
    st.lists(st.text(max_size=5), max_size=12),
    st.lists(st.text(max_size=5), max_size=12),
)
def test_property_common_segments_equals_message_level_lcp(a: list[str], b: list[str]) -> None:
    fa = fingerprint_chat(body(*({"role": "user", "content": t} for t in a)), words)
    fb = fingerprint_chat(body(*({"role": "user", "content": t} for t in b)), words)
    lcp = 0
    for x, y in zip(a, b, strict=False):
        if (x or None) != (y or None):
            break
        lcp += 1
    assert common_segments(fa.hashes, fb.hashes) == 2 + lcp


def test_raw_text_is_blocked_per_chunk_and_a_seen_prefix_is_not_encoded_again() -> None:
    """A raw text prompt is cut into ``CHUNK_CHARS`` chunks, each tokenized (here: one token
    per character) and blocked alone; the chunks' blocks chain. The next turn, the same text
    and more, shares every block of its whole chunks and the blocks before the new text, and
    with the caller's memo only its changed chunks are encoded."""
    encoded: list[str] = []
    memo: dict[tuple[int, str], Blocks] = {}

    def blocks(previous: int, chunk: str) -> Blocks:
        if (previous, chunk) not in memo:
            encoded.append(chunk)
            memo[previous, chunk] = token_blocks([ord(c) for c in chunk], 16, previous)
        return memo[previous, chunk]

    text = "".join(chr(97 + i % 26) for i in range(2 * CHUNK_CHARS + 100))
    fp = fingerprint_text(text, blocks)
    per_chunk = -(-CHUNK_CHARS // 16)
    assert len(fp.hashes) == 2 * per_chunk + 7  # 100 characters: 6 blocks of 16 and one of 4
    assert fp.tokens[per_chunk - 1] == CHUNK_CHARS
    assert fp.total == len(text)
    assert len(encoded) == 3
    following = fingerprint_text(text + "x" * 50, blocks)
    assert common_segments(fp.hashes, following.hashes) == 2 * per_chunk + 6
    assert following.total == len(text) + 50
    assert len(encoded) == 4  # only the last chunk again
    assert fingerprint_text(text, blocks, seed=5).hashes[0] != fp.hashes[0]
    assert fingerprint_text("", blocks).hashes == ()


def test_raw_text_is_cut_at_paragraphs_so_a_prompt_continuing_another_shares_all_of_it() -> None:
    """Agents that send raw prompts append a turn after a blank line. Cut only into blocks
    of 16 tokens, the earlier prompt's short last block never matched the later prompt's
    full one: taubench's 7-word opener was invisible in every prompt that continued it, and
    the shared length the RAM model needs was short by up to 15 tokens. Cut before each
    paragraph too, the earlier prompt is shared whole."""
    counter = TokenCounter()

    def fingerprint(text: str) -> Fingerprint:
        return fingerprint_text(text, lambda at, part: counter.blocks(at, part, 16))

    opener = "Hi! How can I help you today?"
    later = fingerprint(opener + "\n\nWhat changes would you like to make to your reservation?")
    first = fingerprint(opener)
    assert common_segments(first.hashes, later.hashes) == len(first.hashes)
    assert later.tokens_at(len(first.hashes)) == first.total


@given(st.text("ab\n ", max_size=40), st.text("ab\n ", min_size=1, max_size=40))
def test_property_paragraphs_cover_the_text_and_a_continuation_keeps_them(
    head: str, tail: str
) -> None:
    cut = list(paragraphs(head))
    assert "".join(cut) == head
    assert all(cut)
    if head and not head.endswith("\n") and not tail.startswith("\n"):
        assert list(paragraphs(head + "\n\n" + tail))[: len(cut)] == cut


@given(
    st.lists(st.integers(0, 2**31 - 1), max_size=5000),
    st.sampled_from([1, 4, 16, 48, 3000]),
    st.integers(0, 2**32),
)
def test_property_token_ids_in_memoized_chunks_fingerprint_as_whole(
    ids: list[int], block: int, seed: int
) -> None:
    """Chunks of whole blocks chain exactly as one pass over every block does."""
    counter = TokenCounter()
    text = lambda at, part: counter.blocks(at, part, block)  # noqa: E731
    ids_of = lambda at, part: counter.id_blocks(at, part, block)  # noqa: E731
    whole = fingerprint_tokens(ids, block, seed)
    assert fingerprint_raw(ids, text, ids_of, block, seed) == whole
    assert fingerprint_raw(ids, text, ids_of, block, seed) == whole  # from the memo


def test_a_seen_token_id_prefix_is_not_hashed_again() -> None:
    hashed: list[bytes] = []
    memo: dict[tuple[int, bytes], Blocks] = {}

    def id_blocks(previous: int, chunk: bytes) -> Blocks:
        if (previous, chunk) not in memo:
            hashed.append(chunk)
            memo[previous, chunk] = token_blocks(
                [int.from_bytes(chunk[i : i + 4], "little") for i in range(0, len(chunk), 4)],
                16,
                previous,
            )
        return memo[previous, chunk]

    ids = list(range(5000))
    first = fingerprint_raw(ids, lambda at, part: ((), ()), id_blocks, 16)
    assert len(hashed) == 3  # 2048 + 2048 + 904 ids
    longer = fingerprint_raw([*ids, 7, 8], lambda at, part: ((), ()), id_blocks, 16)
    assert len(hashed) == 4  # only the last chunk, which changed
    assert longer.hashes[: len(first.hashes) - 1] == first.hashes[:-1]
    assert first == fingerprint_tokens(ids, 16)


def test_a_list_not_all_token_ids_counts_as_its_text() -> None:
    seen: list[str] = []

    def text_blocks(previous: int, chunk: str) -> Blocks:
        seen.append(chunk)
        return token_blocks([ord(c) for c in chunk], 16, previous)

    for prompt in (["ab", [1, 2]], [1, "a"], [1.5], [[1, 2], [3]]):
        fingerprint_raw(prompt, text_blocks, lambda at, part: ((), ()), 16)
        assert seen[-1] == str(prompt)


def _agent(system: str, user: str = "Fix the bug.", seed: int = 0) -> Fingerprint:
    tools = [{"type": "function", "function": {"name": "read"}}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return fingerprint_chat({"messages": messages, "tools": tools}, len, seed)


RULES = "You are a coding agent. " + " ".join(f"Rule {i} holds." for i in range(300))


def test_prompts_parting_in_a_last_line_of_the_system_prompt_share_the_rest() -> None:
    """The server reuses to the token: two sessions whose system prompts differ only in a
    last line share all of it but the piece holding that line."""
    a, b = _agent(RULES + "\nsession=alpha"), _agent(RULES + "\nsession=beta")
    assert common_segments(a.hashes, b.hashes) == 1  # the tools only, by whole segments
    system = a.tokens[1] - a.tokens[0]
    shared = shared_tokens(a, b)
    assert a.tokens[0] + system - PART_BYTES * system // len(RULES) <= shared < a.tokens[1]
    assert shared_tokens(b, a) == shared


def test_prompts_parting_early_or_in_their_first_user_message_share_no_piece() -> None:
    a = _agent(RULES)
    assert shared_tokens(a, _agent("Another agent. " + RULES)) == a.tokens[0]
    # the first user message is where a conversation starts: never counted in part
    long = "Conversation one. " + "x " * 600
    c, d = _agent(RULES, long + "one"), _agent(RULES, long + "two")
    assert shared_tokens(c, d) == c.tokens[1]


def test_no_piece_is_shared_across_tenants() -> None:
    """Under cache isolation each tenant's chains, pieces too, are salted apart."""
    a, b = _agent(RULES + "\na", seed=1), _agent(RULES + "\nb", seed=2)
    assert shared_tokens(a, b) == 0


def test_a_prefix_keeps_what_is_known_of_its_segments() -> None:
    """A slot's content cut short (a shorter KV, a restored prefix) keeps its user messages'
    starts and its pieces within the segments kept."""
    fp = _agent(RULES + "\nsession=alpha")
    fp = fp.extend(
        [reply_segment("ok", None), message_segment({"role": "user", "content": "on"})], len
    )
    cut = fp.prefix(3)
    assert cut.hashes == fp.hashes[:3]
    assert cut.users == (2,)
    assert cut.parts == fp.parts
    assert fp.prefix(1).parts == ()
