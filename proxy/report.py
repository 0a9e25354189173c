"""``llama-cache-proxy report``: a readable summary of prefix churn from a running proxy.

It reads ``GET /admin/churn`` (bearer token) and prints the sessions that lost the most
tokens to prompts that stopped extending their previous prompt, where in the prompt that
happens (message index and role), and the most recent examples with both sides of the first
difference — what a user needs when the hit rate is low and the cause is in the client (a
timestamp in the system prompt, tools that change order, rewritten history).
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any, TextIO


def fetch(url: str, token: str | None) -> dict[str, Any]:
    request = urllib.request.Request(url.rstrip("/") + "/admin/churn")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as resp:
        found: dict[str, Any] = json.loads(resp.read())
        return found


def render(status: dict[str, Any], out: TextIO) -> None:
    print(f"sessions tracked: {status['sessions_tracked']}", file=out)
    top = status["top_sessions"]
    if not top:
        print("no prefix churn seen: every prompt extended its session's previous one", file=out)
        return
    print("\ntop sessions by tokens lost to prefix churn:", file=out)
    for row in top[:10]:
        print(
            f"  {row['tokens_lost']:>9} tokens  {row['divergences']:>4}x  {row['session']}",
            file=out,
        )
    print("\nwhere prompts first differ (message index, role):", file=out)
    for where, count in status["where"].items():
        print(f"  {count:>5}x  message {where}", file=out)
    print(
        "\nrecent examples (previous prompt | new prompt, around the first difference):", file=out
    )
    for d in status["recent"][-5:]:
        print(
            f"  {d['session']}: message {d['message_index']} ({d['role']}), "
            f"offset ~{d['token_offset']} tokens, ~{d['tokens_lost']} lost",
            file=out,
        )
        print(f"    - {d['before']!r}", file=out)
        print(f"    + {d['after']!r}", file=out)


def run_report(url: str, token: str | None, out: TextIO = sys.stdout) -> int:
    try:
        status = fetch(url, token)
    except urllib.error.HTTPError as exc:
        hints = {
            401: " (give the proxy's admin_token with --admin-token)",
            404: " (the proxy runs without admin_token: its admin endpoints are off)",
        }
        hint = hints.get(exc.code, "")
        print(
            f"llama-cache-proxy report: {url}/admin/churn answered {exc.code}{hint}",
            file=sys.stderr,
        )
        return 2
    except (urllib.error.URLError, OSError) as exc:
        print(f"llama-cache-proxy report: cannot reach {url}: {exc}", file=sys.stderr)
        return 2
    except ValueError:  # (not JSON)
        status = {}
    try:
        render(status, out)
    except (TypeError, KeyError, AttributeError, ValueError):  # (not the proxy's answer)
        print(
            f"llama-cache-proxy report: {url}/admin/churn is not a llama-cache-proxy's answer",
            file=sys.stderr,
        )
        return 2
    return 0
