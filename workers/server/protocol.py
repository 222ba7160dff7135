"""Every message that crosses a socket, as a dataclass, and its wire form (one JSON object).

Frontend -> every rank (sequenced: ``seq`` = 1, 2, 3, ... in one global order):
    ``Generate``, ``Abort``, ``Shutdown``.
Ranks -> frontend (unsequenced; one PULL socket in the frontend):
    ``Ready`` (every rank, once its engine is built), ``Heartbeat`` (every rank, periodically),
    ``StepOutput`` (DP-group leaders: token deltas and queue statistics), ``RequestError``
    (a leader refused a request), ``RankExit`` (a rank is leaving, and why).

The wire form is ``{"type": <class name>, **fields}``; nested messages (``TokenDelta``,
``QueueStats``, ``ModelInfo``) are plain objects inside. Decoding refuses unknown types and
fields with a ``ProtocolError`` naming them.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union


class ProtocolError(ValueError):
    """A message that cannot be decoded (unknown type, missing or unknown field)."""


# ---- frontend -> ranks ------------------------------------------------------------------------

@dataclass(frozen=True)
class Generate:
    """Start request ``rid`` on DP group ``dp_rank`` (the other groups skip it)."""

    seq: int
    rid: str
    dp_rank: int
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    sent_at: float = 0.0        # time.time() when the frontend sent it (wake-up measurement)
    stop_token_ids: list[int] = field(default_factory=list)   # beside the model's EOS ids
    ignore_eos: bool = False    # the model's EOS ids do not stop it (stop_token_ids still do)
    # sampling features (workers.sampling.SamplingParams; ranges: admission.generate_refusal)
    top_k: int = 0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None          # alternatives per generated token (None: no logprobs)
    prompt_logprobs: Optional[int] = None   # alternatives per prompt token (None: none)


@dataclass(frozen=True)
class Abort:
    """Finish request ``rid`` early (client gone, stop string hit); its KV is freed."""

    seq: int
    rid: str


@dataclass(frozen=True)
class Shutdown:
    """Leave the serving loop (sent by the frontend when it stops)."""

    seq: int
    reason: str = ""
    error: bool = False         # the cluster failed (ranks exit non-zero)


ControlMessage = Union[Generate, Abort, Shutdown]


# ---- ranks -> frontend ------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelInfo:
    """What the frontend needs to validate and encode requests."""

    max_context_len: int
    bos_token_id: Optional[int]
    eos_token_ids: list[int]
    vocab_size: int
    mode: str                   # "no speculation", "static steps=3", "adaptive (...)"
    tokenizer_dir: Optional[str] = None   # the target directory (its tokenizer); None: bytes


@dataclass(frozen=True)
class Ready:
    """Rank ``rank`` has built its engine and serves."""

    rank: int
    dp_rank: int
    is_leader: bool
    pid: int
    model: ModelInfo
    kv_usable_pages: int = 0
    host_id: Optional[str] = None   # `launch.host_id()`: the frontend may watch `pid` when equal


@dataclass(frozen=True)
class Heartbeat:
    """Rank ``rank`` (process ``pid``) is alive; ``dropped``: the messages its inbox dropped so
    far, by reason (``channel.REASONS``)."""

    rank: int
    pid: int
    dropped: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of request ``rid`` since the last delta; ``finish_reason`` once it ended
    ("stop": a stop token, "length": max_tokens, "abort": aborted)."""

    rid: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    wake_s: Optional[float] = None          # first delta only: frontend send -> rank applied
    first_token_s: Optional[float] = None   # first delta only: frontend send -> token computed
    queue_s: Optional[float] = None         # first delta only: rank applied -> admitted to a slot
    # with logprobs: one [token_id, logprob, [[id, logprob], ...]] per token of token_ids
    logprobs: Optional[list] = None
    # with prompt_logprobs, once (the first delta): one per prompt token, the first None
    prompt_logprobs: Optional[list] = None


@dataclass(frozen=True)
class QueueStats:
    """One DP group's queue and engine counters, reported by its leader."""

    dp_rank: int
    running_requests: int
    waiting_requests: int
    running_tokens: int
    waiting_tokens: int
    kv_free_pages: int
    kv_usable_pages: int
    steps: int                              # current speculative depth (0 without speculation)
    rounds: int
    round_seconds_total: float
    engine: dict[str, float] = field(default_factory=dict)    # numeric fields of engine.stats
    planner: dict[str, float] = field(default_factory=dict)   # numeric fields of planner.stats
    accept_histogram: dict[str, int] = field(default_factory=dict)
    # speculative decoding, counted over the rounds' requests as vLLM counts them: drafts
    # (request-rounds that drafted), draft tokens proposed, draft tokens accepted, and accepted
    # draft tokens per draft position (index 0: the first draft token)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepOutput:
    """What one DP group produced in one loop iteration."""

    dp_rank: int
    deltas: list[TokenDelta] = field(default_factory=list)
    stats: Optional[QueueStats] = None


@dataclass(frozen=True)
class RequestError:
    """The leader of ``dp_rank`` refused or failed request ``rid`` (``status`` 400 or 500;
    ``param``: the API field at fault, when there is one)."""

    rid: str
    dp_rank: int
    message: str
    status: int = 400
    param: Optional[str] = None


@dataclass(frozen=True)
class RankExit:
    """Rank ``rank`` is leaving; ``error`` when it is a failure rather than an orderly stop."""

    rank: int
    reason: str
    error: bool = False


RankMessage = Union[Ready, Heartbeat, StepOutput, RequestError, RankExit]

_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    Generate, Abort, Shutdown, Ready, Heartbeat, StepOutput, RequestError, RankExit)}
# fields holding nested message objects: (class, field) -> (nested class, is a list)
_NESTED: dict[tuple[type, str], tuple[type, bool]] = {
    (Ready, "model"): (ModelInfo, False),
    (StepOutput, "deltas"): (TokenDelta, True),
    (StepOutput, "stats"): (QueueStats, False),
}
SEQUENCED = (Generate, Abort, Shutdown)


def encode(msg: Any) -> bytes:
    """The wire form of a message."""
    if type(msg).__name__ not in _TYPES:
        raise ProtocolError(f"{type(msg).__name__} is not a protocol message")
    return json.dumps({"type": type(msg).__name__, **dataclasses.asdict(msg)},
                      separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """The message of a wire form; `ProtocolError` naming what is wrong."""
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ProtocolError(f"message is not JSON ({err})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError("message has no 'type' field")
    cls = _TYPES.get(obj.pop("type"))
    if cls is None:
        raise ProtocolError(f"unknown message type; known: {', '.join(sorted(_TYPES))}")
    return _build(cls, obj)


def _build(cls: type, obj: Any) -> Any:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{cls.__name__}: expected an object, got {type(obj).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(obj) - names
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown field(s) {', '.join(sorted(unknown))}")
    for (owner, name), (nested, many) in _NESTED.items():
        if owner is cls and obj.get(name) is not None:
            obj[name] = [_build(nested, x) for x in obj[name]] if many else _build(nested, obj[name])
    try:
        return cls(**obj)
    except TypeError as err:
        raise ProtocolError(f"{cls.__name__}: {err}") from None


# ---- the launch -> frontend hand-over (the frontend's environment, never its command line) ----

CONFIG_ENV = "ADAPTIVE_DIST_FRONTEND_CONFIG"

@dataclass(frozen=True)
class RankAddress:
    """Where rank `rank` (of DP group `dp_rank`) receives control messages."""

    rank: int
    dp_rank: int
    is_leader: bool
    address: str


@dataclass(frozen=True)
class FrontendConfig:
    """Everything the frontend process is started with."""

    host: str
    port: int
    pull_address: str                 # the frontend binds its output PULL socket here
    ranks: list[RankAddress]
    dp: int
    model_name: str
    max_batch_size: int
    max_queue: int
    routing: str                      # "shortest" or "round_robin"
    parent_pid: int                   # rank 0: the frontend stops when it is gone
    dead_after_s: float = 5.0         # a rank silent this long is dead
    linger_s: float = 1.5             # after a failure, keep answering 503 this long, then exit
    chat_template: Optional[str] = None   # --chat-template FILE (None: the model's own)
    http_fd: Optional[int] = None     # the listening socket rank 0 bound (None: bind host:port)
    max_body_size: int = 32 << 20     # --max-body-size
    header_timeout: float = 10.0      # --header-timeout
    body_timeout: float = 60.0        # --body-timeout
    timeout_keep_alive: float = 5.0   # --timeout-keep-alive
    max_connections: int = 1000       # --max-connections, resolved against the file limit
    chat_template_timeout: float = 5.0   # --chat-template-timeout
    failure_fd: Optional[int] = None  # a pipe to rank 0: one byte when the job failed

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> "FrontendConfig":
        obj = json.loads(text)
        obj["ranks"] = [RankAddress(**r) for r in obj["ranks"]]
        return FrontendConfig(**obj)
