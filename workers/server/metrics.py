"""The frontend's counters and the Prometheus text exposition of /metrics.

Frontend-side: requests by outcome, prompt / completion tokens, in-flight requests and the
routing load per DP group, latency summaries (idle wake-up and first token as measured by the
ranks, time to first token and end-to-end latency at the frontend, the frontend's own work before
a request is sent). Per DP group, from its leader's latest ``QueueStats``: running / waiting
requests and tokens, free KV pages, the depth in force, switches, rounds and their time, the
accept-length histogram, and every numeric field of ``engine.stats`` / ``engine.planner.stats``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

PREFIX = "adaptive_dist"


@dataclass
class Summary:
    """Sum, count and maximum of observed values."""

    total: float = 0.0
    count: int = 0
    max: float = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        self.max = max(self.max, value)


@dataclass
class FrontendMetrics:
    requests: Counter = field(default_factory=Counter)         # outcome -> count
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wake: Summary = field(default_factory=Summary)             # frontend send -> rank applied
    rank_first_token: Summary = field(default_factory=Summary)  # frontend send -> first token
    ttft: Summary = field(default_factory=Summary)             # HTTP request -> first token
    latency: Summary = field(default_factory=Summary)          # HTTP request -> last token
    frontend_pre: Summary = field(default_factory=Summary)     # HTTP request -> Generate sent


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._declared: set[str] = set()

    def metric(self, name: str, kind: str, help_text: str,
               samples: Iterable[tuple[dict[str, Any], float]], suffix: str = "") -> None:
        full = f"{PREFIX}_{name}"
        if full not in self._declared:
            self.lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
            self._declared.add(full)
        for labels, value in samples:
            self.lines.append(f"{full}{suffix}{_labels(labels)} {_num(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _labels(labels: dict[str, Any]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render(metrics: FrontendMetrics, *, healthy: bool, ranks: int, ranks_ready: int,
           in_flight: int, loads: list[int], stats: dict[int, Any]) -> str:
    """The /metrics page."""
    w = _Writer()
    w.metric("healthy", "gauge", "1 when every rank is ready and nothing failed",
             [({}, int(healthy))])
    w.metric("ranks", "gauge", "engine ranks of the job", [({}, ranks)])
    w.metric("ranks_ready", "gauge", "ranks that reported ready", [({}, ranks_ready)])
    w.metric("requests_total", "counter", "completion requests by outcome",
             [({"outcome": k}, v) for k, v in sorted(metrics.requests.items())])
    w.metric("prompt_tokens_total", "counter", "prompt tokens of accepted requests",
             [({}, metrics.prompt_tokens)])
    w.metric("generation_tokens_total", "counter", "tokens generated for clients",
             [({}, metrics.completion_tokens)])
    w.metric("requests_in_flight", "gauge", "sub-requests (one per prompt) not finished yet",
             [({}, in_flight)])
    w.metric("dp_outstanding_tokens", "gauge",
             "routing load: outstanding tokens per DP group (frontend bookkeeping)",
             [({"dp_rank": g}, v) for g, v in enumerate(loads)])
    for name, summary, help_text in (
            ("wake_seconds", metrics.wake, "frontend send -> the rank applied the request"),
            ("rank_first_token_seconds", metrics.rank_first_token,
             "frontend send -> first token computed on the rank"),
            ("time_to_first_token_seconds", metrics.ttft, "HTTP request -> first token"),
            ("request_latency_seconds", metrics.latency, "HTTP request -> last token"),
            ("frontend_pre_seconds", metrics.frontend_pre,
             "HTTP request -> Generate sent (parsing, validation, encoding, routing)")):
        w.metric(name, "summary", help_text, [({}, summary.total)], "_sum")
        w.metric(name, "summary", help_text, [({}, summary.count)], "_count")
        w.metric(f"{name}_max", "gauge", f"maximum of {name}", [({}, summary.max)])
    for g in sorted(stats):
        _dp_group(w, g, stats[g])
    return w.text()


def _dp_group(w: _Writer, g: int, s: Any) -> None:
    dp = {"dp_rank": g}
    w.metric("queue_requests", "gauge", "requests per DP group and state",
             [({**dp, "state": "running"}, s.running_requests),
              ({**dp, "state": "waiting"}, s.waiting_requests)])
    w.metric("queue_tokens", "gauge", "tokens per DP group and state",
             [({**dp, "state": "running"}, s.running_tokens),
              ({**dp, "state": "waiting"}, s.waiting_tokens)])
    w.metric("kv_free_pages", "gauge", "target KV pages neither allocated nor promised",
             [(dp, s.kv_free_pages)])
    w.metric("kv_usable_pages", "gauge", "target KV pages requests can use",
             [(dp, s.kv_usable_pages)])
    w.metric("spec_steps", "gauge", "speculative depth in force (0: no speculation)",
             [(dp, s.steps)])
    switches = s.planner.get("switches", s.engine.get("switches", 0.0))
    w.metric("switches_total", "counter", "depth switches", [(dp, switches)])
    w.metric("rounds_total", "counter", "engine rounds run by the server", [(dp, s.rounds)])
    w.metric("round_seconds_total", "counter", "time spent in engine rounds",
             [(dp, s.round_seconds_total)])
    _histogram(w, dp, {int(k): v for k, v in s.accept_histogram.items()})
    w.metric("engine_stat", "gauge", "numeric fields of engine.stats",
             [({**dp, "stat": k}, v) for k, v in sorted(s.engine.items())])
    w.metric("planner_stat", "gauge", "numeric fields of engine.planner.stats",
             [({**dp, "stat": k}, v) for k, v in sorted(s.planner.items())])


def _histogram(w: _Writer, dp: dict[str, Any], hist: dict[int, int]) -> None:
    help_text = "accepted draft tokens per request per round (bonus excluded)"
    top = max(hist, default=0)
    running, buckets = 0, []
    for k in range(top + 1):
        running += hist.get(k, 0)
        buckets.append(({**dp, "le": str(k)}, running))
    buckets.append(({**dp, "le": "+Inf"}, running))
    w.metric("accept_length", "histogram", help_text, buckets, "_bucket")
    w.metric("accept_length", "histogram", help_text,
             [(dp, sum(k * v for k, v in hist.items()))], "_sum")
    w.metric("accept_length", "histogram", help_text, [(dp, running)], "_count")


def parse(text: str) -> dict[str, float]:
    """`name{labels}` -> value of a Prometheus text page (for tests and the benchmark)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def find(samples: dict[str, float], name: str, **labels: Any) -> Optional[float]:
    """The value of `name` with exactly `labels` in parsed samples (None if absent)."""
    return samples.get(f"{PREFIX}_{name}{_labels(labels)}")
