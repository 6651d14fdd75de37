"""GET /stats.json: what the live page draws, from the /metrics text and the slots.

Totals (tokens, time, drafts, the time split, queue, link state) are read back
from the exposition that /metrics serves (see exposition.py), so the page and a
Prometheus scrape never disagree. What /metrics has no series for comes from
the running server itself: the last requests and acceptance by draft position
(recent.py), each draft node's handshake round trip and last error (its Link),
and the plain rate the target decodes at: every round without a draft (the
drafter had nothing ready, or the policy chose a plain step, or the request
turned speculation off) is one plain decoding step, and its time is measured.
"""

from __future__ import annotations

import math
import time

from specwire.drafters.base import LinkStatus
from specwire.server.slots import SlotPool
from specwire.server.webui.exposition import Exposition
from specwire.server.webui.recent import RecentRequests

PHASES = ("draft", "network", "verify")


def snapshot(metrics_text: str, scheduler: SlotPool, recent: RecentRequests,
             about: dict, key: str | None = None) -> dict:
    """The JSON the page polls: one consistent reading of every figure it shows. key: the
    caller's API key scope (None: a server without keys): with keys the page lists only
    the caller's own requests, as /slots shows only its own slots' details; the totals
    are /metrics' (every key's, as a scrape shows them)."""
    rows, served = recent.rows_of(key)
    e = Exposition.parse(metrics_text)
    tokens, seconds = e.total("tokens_predicted_total"), e.total("tokens_predicted_seconds_total")
    drafted, accepted = e.total("draft_tokens_total"), e.total("draft_tokens_accepted_total")
    hist = _histogram(e.by("draft_accepted_length_total", "accepted"))
    rate = tokens / seconds if seconds > 0 else None
    plain = recent.plain_tokens_per_s
    rounds = e.total("draft_rounds_total")
    split = e.by("round_seconds_total", "phase")
    return {
        "about": {**about, "uptime_s": round(time.time() - about.get("started", time.time()))},
        "speed": {
            "tokens_per_s": _r(rate), "plain_tokens_per_s": _r(plain),
            "plain_steps": recent.plain_steps,
            "speedup": _r(rate / plain) if rate and plain else None,
            "tokens_predicted": int(tokens), "predicted_seconds": _r(seconds),
            "prompt_tokens": int(e.total("prompt_tokens_total")),
            "prompt_seconds": _r(e.total("prompt_seconds_total")),
        },
        "drafts": {
            "drafted": int(drafted), "accepted": int(accepted),
            "acceptance": _r(accepted / drafted) if drafted else None,
            "rounds": int(rounds), "accepted_hist": hist,
            "mean_accepted": _r(sum(i * c for i, c in enumerate(hist)) / sum(hist))
            if sum(hist) else None,
            "by_position": [list(p) for p in recent.by_position],
        },
        "time_split": {p: {"seconds": _r(split.get(p, 0.0)),
                           "ms_per_round": _r(1000 * split.get(p, 0.0) / rounds) if rounds else 0}
                       for p in PHASES},
        "queue": {"processing": int(e.total("requests_processing")),
                  "deferred": int(e.total("requests_deferred")),
                  "capacity": int(e.total("queue_capacity")),
                  "rejected": int(e.total("requests_rejected_total")),
                  "finished": {k: int(v) for k, v in
                               e.by("requests_finished_total", "outcome").items()},
                  "requests": {k: int(v) for k, v in
                               e.by("requests_total", "endpoint").items()}},
        "slots": [{"id": s.index, "busy": s.job is not None, "drafter": s.engine.drafter.name}
                  for s in scheduler.slots],
        "nodes": draft_nodes(e, scheduler),
        "speculation": scheduler.watch.states(),
        "served": served,
        "recent": rows,
    }


def draft_nodes(e: Exposition, scheduler: SlotPool) -> list[dict]:
    """Each slot's draft links: up or not (the scrape's figure), and what its drafter
    declares of them (LinkStatus)."""
    details: dict[tuple[str, str], dict] = {}
    for s in scheduler.slots:
        for link in s.links() or ():
            if link.model is not None:      # a node's details (a llama-server has none)
                details[(str(s.index), link.url)] = _link(link)
    out = []
    for labels, up in e.rows("draft_link_up"):
        key = (labels.get("slot", ""), labels.get("link", ""))
        out.append({"slot": int(key[0]) if key[0].isdigit() else key[0], "url": key[1],
                    "up": bool(up), **details.get(key, {})})
    return out


def _link(link: LinkStatus) -> dict:
    rtt, retry = link.rtt_s, link.retry_in_s or 0.0
    return {"model": link.model,
            "rtt_ms": _r(1000 * rtt) if rtt is not None and math.isfinite(rtt) else None,
            "failures": link.failures or 0,
            "error": link.error or "",
            "retry_in_s": _r(retry) if retry > 0 else 0,
            "step": None if link.step is None else {"sessions": link.step[0],
                                                    "alternates": link.step[1]}}


def _histogram(by_length: dict[str, float]) -> list[int]:
    lengths = {int(k): int(v) for k, v in by_length.items() if k.isdigit()}
    if not lengths:
        return []
    return [lengths.get(n, 0) for n in range(max(lengths) + 1)]


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, digits)

