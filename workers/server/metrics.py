"""The frontend's counters and the Prometheus text exposition of /metrics.

Frontend-side: requests by outcome, prompt / completion tokens, in-flight requests and the
routing load per DP group, latency summaries (idle wake-up and first token as measured by the
ranks, the frontend's own work before a request is sent) and histograms with buckets, named as
vLLM names the same measurements (time to first token, inter-token latency, time per output
token, end-to-end latency, queue time). Per DP group, from its leader's latest ``QueueStats``:
running / waiting requests and tokens, free KV pages and the KV usage ratio, the depth in force,
switches, rounds and their time, the accept-length histogram, vLLM's speculative-decoding
counters (drafts, draft tokens, accepted tokens, accepted tokens per draft position), and every
numeric field of ``engine.stats`` / ``engine.planner.stats``. Every series has a ``model_name``
label (the served name). docs/serving.md maps the names to vLLM's.
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


TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0,
                 10.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0,
                   600.0, 1800.0)


@dataclass
class Histogram(Summary):
    """A summary with cumulative bucket counts (Prometheus `le` buckets, `+Inf` is `count`)."""

    buckets: tuple[float, ...] = TTFT_BUCKETS
    counts: list[int] = field(default_factory=list)

    def observe(self, value: float) -> None:
        super().observe(value)
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1

    def cumulative(self) -> list[tuple[str, int]]:
        counts = self.counts or [0] * len(self.buckets)
        return [(_num(edge), c) for edge, c in zip(self.buckets, counts)] + [("+Inf", self.count)]


@dataclass
class FrontendMetrics:
    requests: Counter = field(default_factory=Counter)         # outcome -> count
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wake: Summary = field(default_factory=Summary)             # frontend send -> rank applied
    rank_first_token: Summary = field(default_factory=Summary)  # frontend send -> first token
    ttft: Histogram = field(default_factory=Histogram)         # HTTP request -> first token
    latency: Summary = field(default_factory=Summary)          # HTTP request -> last token
    frontend_pre: Summary = field(default_factory=Summary)     # HTTP request -> Generate sent
    # vLLM's request histograms (e2e: the same observations as `latency`, with buckets)
    e2e: Histogram = field(default_factory=lambda: Histogram(buckets=REQUEST_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(buckets=TOKEN_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(buckets=TOKEN_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(buckets=TTFT_BUCKETS))
    # the perimeter (docs/serving.md, "Security")
    http_rejected: Counter = field(default_factory=Counter)   # reason -> requests refused
    refused_connections: Any = None        # perimeter.RateLimitedLog (its total)
    open_connections: Any = None           # () -> connections open now
    template_failures: Counter = field(default_factory=Counter)   # kind -> chat renders failed
    dropped: Any = None                    # () -> {receiver: {reason: count}}


class _Writer:
    def __init__(self, model_name: str = "") -> None:
        self.lines: list[str] = []
        self._declared: set[str] = set()
        self.base = {"model_name": model_name}

    def metric(self, name: str, kind: str, help_text: str,
               samples: Iterable[tuple[dict[str, Any], float]], suffix: str = "") -> None:
        full = f"{PREFIX}_{name}"
        if full not in self._declared:
            self.lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
            self._declared.add(full)
        for labels, value in samples:
            self.lines.append(f"{full}{suffix}{_labels({**self.base, **labels})} {_num(value)}")

    def histogram(self, name: str, help_text: str, h: Histogram) -> None:
        self.metric(name, "histogram", help_text,
                    [({"le": le}, c) for le, c in h.cumulative()], "_bucket")
        self.metric(name, "histogram", help_text, [({}, h.total)], "_sum")
        self.metric(name, "histogram", help_text, [({}, h.count)], "_count")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _labels(labels: dict[str, Any]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render(metrics: FrontendMetrics, *, healthy: bool, ranks: int, ranks_ready: int,
           in_flight: int, loads: list[int], stats: dict[int, Any], model_name: str = "") -> str:
    """The /metrics page; every series is labelled ``model_name``."""
    w = _Writer(model_name)
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
            ("time_to_first_token_seconds", metrics.ttft,
             "HTTP request -> its first token at the frontend"),
            ("request_latency_seconds", metrics.latency, "HTTP request -> last token"),
            ("frontend_pre_seconds", metrics.frontend_pre,
             "HTTP request -> Generate sent (parsing, validation, encoding, routing)")):
        if isinstance(summary, Histogram):
            w.histogram(name, help_text, summary)
        else:
            w.metric(name, "summary", help_text, [({}, summary.total)], "_sum")
            w.metric(name, "summary", help_text, [({}, summary.count)], "_count")
        w.metric(f"{name}_max", "gauge", f"maximum of {name}", [({}, summary.max)])
    for name, h, help_text in (
            ("e2e_request_latency_seconds", metrics.e2e,
             "HTTP request -> its last token (finished requests)"),
            ("inter_token_latency_seconds", metrics.itl,
             "time between two token deliveries of one choice (a round's tokens arrive "
             "together: one observation per delivery after the first)"),
            ("request_time_per_output_token_seconds", metrics.tpot,
             "per finished choice: (last token - first token) / (tokens - 1)"),
            ("request_queue_time_seconds", metrics.queue_time,
             "on the rank: request applied -> admitted into the running batch")):
        w.histogram(name, help_text, h)
    _perimeter(w, metrics)
    for g in sorted(stats):
        _dp_group(w, g, stats[g])
    return w.text()


def _perimeter(w: _Writer, metrics: FrontendMetrics) -> None:
    w.metric("http_rejected_total", "counter",
             "HTTP requests refused before they ran, by reason (body_too_large: 413, "
             "body_timeout / header_timeout: 408)",
             [({"reason": k}, v) for k, v in sorted(metrics.http_rejected.items())])
    refused = metrics.refused_connections.total if metrics.refused_connections else 0
    w.metric("http_connections_refused_total", "counter",
             "connections closed at once at the connection cap (--max-connections)",
             [({}, refused)])
    if metrics.open_connections is not None:
        w.metric("http_connections_open", "gauge", "HTTP connections open now",
                 [({}, metrics.open_connections())])
    w.metric("chat_template_failures_total", "counter",
             "chat template renders that failed, by kind (refused: raise_exception; error: any "
             "other failure; timeout: --chat-template-timeout; too_long: the output bound)",
             [({"kind": k}, v) for k, v in sorted(metrics.template_failures.items())])
    dropped = metrics.dropped() if metrics.dropped is not None else {}
    w.metric("dropped_messages_total", "counter",
             "internal messages dropped: not sealed with this job's key (unauthenticated), "
             "seen before (replayed), or undecodable (malformed); by receiving process",
             [({"receiver": who, "reason": reason}, n)
              for who, counts in sorted(dropped.items()) for reason, n in sorted(counts.items())])


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
    w.metric("num_requests_running", "gauge", "requests in the running batch (vLLM's name)",
             [(dp, s.running_requests)])
    w.metric("num_requests_waiting", "gauge", "requests waiting for a slot (vLLM's name)",
             [(dp, s.waiting_requests)])
    used = 1.0 - s.kv_free_pages / s.kv_usable_pages if s.kv_usable_pages else 0.0
    w.metric("kv_cache_usage_perc", "gauge",
             "fraction of the KV pages in use or promised, 0 to 1 (vLLM's name)", [(dp, used)])
    w.metric("spec_decode_num_drafts_total", "counter",
             "drafts: one per request per round that drafted (depth > 0)", [(dp, s.spec_drafts)])
    w.metric("spec_decode_num_draft_tokens_total", "counter", "draft tokens proposed",
             [(dp, s.spec_draft_tokens)])
    w.metric("spec_decode_num_accepted_tokens_total", "counter", "draft tokens accepted",
             [(dp, s.spec_accepted_tokens)])
    w.metric("spec_decode_num_accepted_tokens_per_pos_total", "counter",
             "draft tokens accepted at each draft position (0: the first draft token)",
             [({**dp, "position": i}, n) for i, n in enumerate(s.spec_accepted_per_pos)])
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
    """The value of `name` with exactly `labels` in parsed samples (None if absent); the
    ``model_name`` label every series has matches any value unless `labels` names it."""
    want = {k: str(v) for k, v in labels.items()}
    full = f"{PREFIX}_{name}"
    for key, value in samples.items():
        metric, _, rest = key.partition("{")
        if metric != full:
            continue
        got = _parse_labels(rest[:-1]) if rest else {}
        if "model_name" not in want:
            got.pop("model_name", None)
        if got == want:
            return value
    return None


def _parse_labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(text):
        eq = text.index("=", i)
        key, j, value = text[i:eq], eq + 2, []
        while text[j] != '"':
            if text[j] == "\\":
                j += 1
                value.append({"n": "\n"}.get(text[j], text[j]))
            else:
                value.append(text[j])
            j += 1
        out[key] = "".join(value)
        i = j + 2          # past the closing quote and the comma
    return out
