"""Mispredictions: replayed requests served far less than the router predicted, each with the
fleet as the router saw it when it placed the request.

    python -m bench.mispredict [--only mooncake/conversation_trace] [--runs 3] \\
        [--min-predicted 100] [--show 10] [--routing JSON] [--request SESSION,TURN ...]

Replays one workload in process (``bench.replay``'s fakes and fleet) and flags every request
predicted at least ``--min-predicted`` tokens (``X-Cache-Predicted-Tokens``, the backend's
tokens) that was served under half of that (the fakes' ``cached_tokens``). For each it prints
the decision that placed it and, at that moment, the chosen slot's content (estimate, real
length, the share the request keeps of it) and the backend's RAM-cache entries that serve
the prompt, and every slot of the fleet (``--request`` shows given requests the same way,
whatever they were served): enough to tell a wrong model of the server (the server did not
do what the router expected) from a right model of a state that changed before the request
ran.

The prediction in the header is in the backend's tokens through one scale per backend, so a
text that tokenizes far off that scale shows up without a wrong decision: on taubench, whose
turns range from prose to JSON, most flagged requests are slots holding exactly what was
predicted (the request keeps all of their content by segments) at a third of the average scale.

A replay found this way that a slot kept at exactly half by the server's count, a little
under by the estimate, was predicted to load a RAM copy the server never consulted
(``ram_cache.SURE_CONSULT``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Mapping
from typing import Any

from bench import replay
from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.routing import scoring
from proxy.core.routing.decision import Decision
from proxy.core.server.fleet import BackendState, Placement
from proxy.routing.router import Plan, Router


def _fleet_view(decision: Decision, fp: Fingerprint, backends: list[BackendState]) -> str:
    placement = decision.placement
    assert placement is not None
    assert placement.pin is not None
    backend = backends[placement.backend]
    slot = backend.slots[placement.pin]
    lines = [
        f"  decided {decision.reason}, predicted {decision.predicted} (estimate) of "
        f"{fp.total}, on backend {backend.index} slot {slot.id}"
        + (f", loading a RAM entry of {ram.content.total}" if (ram := placement.from_ram) else "")
    ]
    content = slot.content
    if content is not None:
        kept = fp.tokens_at(scoring.shared_segments(fp, content))
        length = backend.kv_estimate(content, slot.n_tokens)
        lines.append(
            f"  slot content {content.total} (estimate), {slot.n_tokens} real, KV {length} "
            f"(estimate): the request keeps {kept} ({kept / max(1, length):.2f} of it)"
        )
    else:
        lines.append("  slot empty")
    for other in backends:  # the whole fleet: what the other choices were
        for each in other.slots:
            held = each.content.total if each.content is not None else "-"
            lines.append(
                f"    backend {other.index} slot {each.id}: {each.phase.name.lower()}, holds "
                f"{held} (estimate), {each.n_tokens} real, last used {each.last_used:.2f}"
            )
    view = scoring.ram_view(fp, backend)
    serving = [(i, s) for i, s in enumerate(view.served) if s[0] > 0]
    lines.append(
        f"  RAM cache: {len(backend.ram_entries)} entries, serving the prompt (index oldest "
        f"first: tokens, length): {serving[:8]}"
    )
    return "\n".join(lines)


async def run(
    row: str, runs: int, min_predicted: int, show: int, requests: frozenset[tuple[int, int]]
) -> int:
    ((workload, shape),) = replay.scenarios(True, [row])
    backends, slots = shape or (4, 4)
    views: dict[int, str] = {}  # per request (its plan's id): the fleet at its placement
    decider, headers_of = Router.decider, Router.headers

    def traced_decider(router: Router, plan: Plan, avoid: frozenset[int]) -> Any:
        decide = decider(router, plan, avoid)

        def traced() -> Any:
            placement = decide()
            if isinstance(placement, Placement) and plan.decision is not None:
                views[id(plan)] = _fleet_view(plan.decision, plan.fp, router._fleet.backends)
            return placement

        return traced

    def traced_headers(router: Router, plan: Plan) -> dict[str, str]:
        return {**headers_of(router, plan), "X-Bench-Plan": str(id(plan))}

    found: list[str] = []

    def observe(where: tuple[int, int], body: dict[str, Any], headers: Mapping[str, str]) -> None:
        usage = body.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        predicted = int(headers.get("X-Cache-Predicted-Tokens", 0))
        if (predicted >= min_predicted and cached < predicted / 2) or where in requests:
            found.append(
                f"session {where[0]} turn {where[1]}: {usage.get('prompt_tokens')} tokens, "
                f"predicted {predicted}, served {cached} ({headers.get('X-Cache-Route')})\n"
                + views.get(int(headers.get("X-Bench-Plan", 0)), "  (no decision recorded)")
            )

    Router.decider, Router.headers = traced_decider, traced_headers  # type: ignore[method-assign,assignment]
    replay.OBSERVE = observe
    try:
        for i in range(runs):
            before = len(found)
            result = await replay.run_policy("ours", workload, backends, slots, {})
            print(f"run {i}: hit {result.hit:.4f}, {len(found) - before} mispredicted")
    finally:
        Router.decider, Router.headers = decider, headers_of  # type: ignore[method-assign]
        replay.OBSERVE = None
    for text in found[:show]:
        print("\n" + text)
    return len(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="mooncake/conversation_trace")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--min-predicted", type=int, default=100)
    parser.add_argument("--show", type=int, default=10)
    parser.add_argument("--routing", type=json.loads, default={}, help="as bench.replay")
    parser.add_argument(
        "--request", nargs="*", default=[], help="SESSION,TURN: also show these requests"
    )
    args = parser.parse_args()
    replay.ROUTING.update(args.routing)
    pairs = (r.split(",") for r in args.request)
    wanted = frozenset((int(session), int(turn)) for session, turn in pairs)
    asyncio.run(run(args.only, args.runs, args.min_predicted, args.show, wanted))


if __name__ == "__main__":
    main()
