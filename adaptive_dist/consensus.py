"""The per-round consensus collective: one fixed-size vector per rank, reduced over the group
(``scheme="reduce"``, the default: one all-reduce of sums and maxima, ``log2 N`` exchange steps)
or all-gathered (``scheme="gather"``, the former scheme: every rank holds the [N, FIELDS] matrix).
Both give every rank the same ``ClusterRound``, bit for bit: the sums of floats are exact
(fixed-point integers, ``ReducedLayout``), the same value ``reducers.exact_sum`` gives from the
gathered matrix.

The vector carries the rank's statistics (from the round that just ended: its request count, its
EMA of accepted draft tokens, its EMA of the share of requests that rejected a draft token, its
weight), its view of the upcoming round (requests, the tokens and requests of its extend/prefill
forward and its longest prompt, CUDA-graph eligibility, whether it is done; when serving, the
highest request-message sequence number it has received and whether it wants the cluster to
stop), and the state every
rank must share (steps in force, counted rounds, last switch, config hash, hash of the previous
round's plan).
The shared-state columns are the pre-flight lockstep check: a mismatch raises ``DivergenceError``
on every rank, naming ranks and fields, before any device collective of the round is issued.
The reduction carries each must-agree field's maximum and the maximum of its negation (equal iff
every rank agrees); only when a check fails does every rank gather the vectors, to name the
ranks that differ (the slow path).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import operator
import os
import struct
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from collectives import DivergenceError, Group, ops, shm
from adaptive_dist.policy.reducers import Pooled

MAGIC = 0x5ADE  # vector format version (0x5ADC: before tokens and the value curve; 0x5ADB:
                #   before extend_len; 0x5ADA: before period; 0x5AD9: before ema_fail)
FIELDS = (
    "magic", "round", "n_req", "num_tokens", "n_extend", "extend_len", "can_graph",  # the upcoming
    "done",                                                                       # round
    "seq", "leave",                                                     # serving: inbox, stop
    "prev_n_req", "ema", "ema_fail", "weight", "period",                # the round that ended
    "steps", "tokens", "counted", "last_switch", "config_hash", "prev_plan_hash",  # must agree
)
"""The fixed columns; a per-request run appends its value curve (``RoundVector.values``)."""
MUST_AGREE = ("magic", "round", "steps", "tokens", "counted", "last_switch", "config_hash",
              "prev_plan_hash")
COL = {name: i for i, name in enumerate(FIELDS)}
_AGREE_COLS = tuple(COL[name] for name in MUST_AGREE)


def hash48(*parts: object) -> int:
    """A 48-bit hash (exact in float64) of ``parts``' reprs; equal on every rank for equal parts."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=6).digest()
    return int.from_bytes(h, "little")


@dataclass(frozen=True)
class RoundVector:
    """One rank's contribution to a round's consensus."""

    round: int
    n_req: int
    num_tokens: int
    n_extend: int
    can_graph: bool
    done: bool
    seq: int
    leave: bool
    prev_n_req: int
    ema: float
    weight: int
    steps: int
    counted: int
    last_switch: int
    config_hash: int
    prev_plan_hash: int
    ema_fail: float = 1.0  # last in the dataclass (positional callers), placed by FIELDS
    period: float = -1.0   # seconds from the previous round's begin to this one's; -1: untimed
    extend_len: int = 0    # the longest prompt of its extend forward (0: none)
    tokens: int = 0        # per-request: the verify tokens decided for this round (0: a chain)
    values: tuple[int, ...] = ()   # per-request: its value curve (``policy.budgets``), summed

    def row(self) -> list[float]:
        """The gathered row: the fixed columns, then the value curve."""
        return ([float(MAGIC)] + [float(getattr(self, f)) for f in FIELDS[1:]]
                + [float(v) for v in self.values])


CHANNELS = ("control", "device")


class ConsensusChannel:
    """Pre-allocated buffers for the per-round all-gather over ``group``, so a round allocates
    nothing.

    ``channel="control"`` (what the engine uses) all-gathers host memory over the group's gloo
    control group: the planning channel is separate from the device group that carries the
    model's collectives, so a rank that strays from the plan (skips a forward, say) leaves its
    peers waiting in *different* process groups — a timeout the guard diagnoses — instead of
    meeting them inside one group with mismatched tensors (gloo aborts the process; NCCL can
    complete with garbage). ``channel="device"`` uses the device group (pinned host staging and
    one stream synchronisation on CUDA)."""

    def __init__(self, group: Group, channel: str = "control", n_values: int = 0) -> None:
        if channel not in CHANNELS:
            raise ValueError(f"consensus channel={channel!r}; allowed: {', '.join(CHANNELS)}")
        self.group, self.channel = group, channel
        n = self.width = len(FIELDS) + n_values
        cuda = group.device.type == "cuda" and channel == "device"
        self.host_in = torch.zeros(n, dtype=torch.float64, pin_memory=cuda)
        self._host_in = self.host_in.numpy()  # the same memory: filled without a torch op
        self.dev_in = self.host_in.to(group.device) if cuda else self.host_in
        self.host_out = torch.zeros(group.size * n, dtype=torch.float64, pin_memory=cuda)
        self.cuda = cuda

    def gather(self, vec: "RoundVector") -> list[list[float]]:
        """All-gather every member's vector (one collective) and return the [size][width]
        matrix as Python floats, identical on every member (a value curve's integers are exact:
        below 2^53)."""
        self._host_in[:] = vec.row()
        if self.cuda:
            self.dev_in.copy_(self.host_in, non_blocking=True)
        out = ops.all_gather(self.dev_in, self.group, control=self.channel == "control")
        if self.cuda:
            self.host_out.copy_(out, non_blocking=True)
            torch.cuda.current_stream(self.group.device).synchronize()
            flat = self.host_out.tolist()
        else:
            flat = out.tolist()
        n = self.width
        return [flat[i * n:(i + 1) * n] for i in range(self.group.size)]


def preflight(matrix: list[list[float]], group: Group) -> None:
    """Raise ``DivergenceError`` (the same on every rank) if the must-agree columns differ."""
    first = [matrix[0][i] for i in _AGREE_COLS]
    if all([row[i] for i in _AGREE_COLS] == first for row in matrix[1:]):
        return
    bad = []
    for name in MUST_AGREE:
        col = column(matrix, name)
        if any(v != col[0] for v in col):
            values: dict[float, list[int]] = {}
            for i, v in enumerate(col):
                values.setdefault(v, []).append(group.ranks[i])
            shown = ", ".join(f"ranks {rs} have {_fmt(name, v)}" for v, rs in values.items())
            bad.append(f"{name} ({shown})")
    if bad:
        rnd = int(matrix[0][COL["round"]])
        raise DivergenceError(
            f"pre-flight lockstep check failed at round {rnd} on group {group.name!r}: "
            f"ranks disagree on " + "; ".join(bad)
        )


def _fmt(name: str, v: float) -> str:
    if name.endswith("hash") or name == "magic":
        return f"{int(v):#x}"
    return str(int(v)) if float(v).is_integer() else repr(v)


def column(matrix: list[list[float]], name: str) -> list[float]:
    i = COL[name]
    return [row[i] for row in matrix]


def columns(matrix: list[list[float]]) -> dict[str, Sequence[float]]:
    """Every column of ``matrix`` by field name (one pass, for a round that reads many)."""
    return dict(zip(FIELDS, zip(*matrix)))


@functools.lru_cache(maxsize=1024)
def plan_hash(steps: int, tokens: int, use_graph: bool, bucket: int | None) -> int:
    """Hash of what a rank runs in a round: its shape (draft forwards, verify tokens), graph or
    eager, padded bucket."""
    return hash48(int(steps), int(tokens), bool(use_graph), bucket)


# ============================================================================ the reduced round
SCHEMES = ("reduce", "gather")
REDUCED_MAGIC = 0x5ADD   # the reduced vector's format (the gathered one is MAGIC)

LIMB_BITS = 40           # a signed digit per int64 limb: sums of up to 2^23 ranks cannot overflow
FRACTION_BITS = 1074     # every finite float64 is an integer multiple of 2^-1074
LIMBS = 29               # 29 * 40 = 1160 bits: |term| < 2^86 is exact
_MASK = (1 << LIMB_BITS) - 1
_SHIFTS = tuple(LIMB_BITS * k for k in range(LIMBS))
_SCALE = 1 << FRACTION_BITS
_LOW = -(1 << 63) + 1    # the MAX of a rank that has nothing to say (no weight)
_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")
_pack_f64, _unpack_f64, _pack_i64, _unpack_i64 = _F64.pack, _F64.unpack, _I64.pack, _I64.unpack
_compress = itertools.compress
_DIGITS = tuple(range(LIMBS))
_F1075 = FRACTION_BITS + 1            # 1074 - log2(d) is _F1075 - d.bit_length()
_TWO_LIMBS = 2 * LIMB_BITS
_SIGN = 1 << 63
_lshift = operator.lshift


def float_key(x: float) -> int:
    """An int64 with the order of float64 ``x`` (the maximum of keys is the key of the
    maximum); ``key_float`` inverts it (-0.0 maps to +0.0)."""
    b = _unpack_i64(_pack_f64(x))[0]
    return b if b >= 0 else -(b & 0x7FFFFFFFFFFFFFFF)


def key_float(k: int) -> float:
    return _unpack_f64(_pack_i64(k))[0] if k >= 0 else -_unpack_f64(_pack_i64(-k))[0]


def put_fixed(t: float, out: list, base: int) -> bool:
    """Write float64 ``t`` as the integer ``t·2^1074`` in signed base-2^40 digits into
    ``out[base:base+LIMBS]`` (zeros beforehand); False when it does not fit (non-finite, or
    |t| ≥ 2^86), and the round's sums then come from the gathered vectors.

    ``t = n / d`` exactly (``float.as_integer_ratio``: ``d`` a power of two). A ``t`` with a
    fraction has ``|n| < 2^53`` and ``2 <= d <= 2^1074``: ``n·2^(1074 - log2 d)`` has at most
    three nonzero digits, from digit ``(1074 - log2 d) // 40 <= 26``, so three writes stay
    inside the ``LIMBS`` (the zero digits among them were zero already). An integral ``t``
    takes the digit loop (``_put_wide``), which stops where the digits run out of room."""
    if t == 0.0:
        return True
    try:
        n, d = t.as_integer_ratio()
    except (OverflowError, ValueError):   # ±inf, nan
        return False
    if d == 1:
        return _put_wide(n, out, base)
    pos = _F1075 - d.bit_length()         # 1074 - log2(d): 0 <= pos <= 1073
    k = base + pos // LIMB_BITS
    if n < 0:
        v = -n << (pos % LIMB_BITS)
        out[k:k + 3] = -(v & _MASK), -((v >> LIMB_BITS) & _MASK), -(v >> _TWO_LIMBS)
    else:
        v = n << (pos % LIMB_BITS)
        out[k:k + 3] = v & _MASK, (v >> LIMB_BITS) & _MASK, v >> _TWO_LIMBS
    return True


def _put_wide(n: int, out: list, base: int) -> bool:
    """``put_fixed`` of the integer ``n`` (``n·2^1074``), digit by digit: False once a nonzero
    digit falls past the ``LIMBS`` (the digits below are written, as the gather path ignores
    them)."""
    sign = -1 if n < 0 else 1
    v, k = abs(n) << (FRACTION_BITS % LIMB_BITS), base + FRACTION_BITS // LIMB_BITS
    end = base + LIMBS
    while v:
        if k >= end:
            return False
        out[k] = sign * (v & _MASK)
        v >>= LIMB_BITS
        k += 1
    return True


def get_fixed(limbs: Sequence[int]) -> float:
    """The float64 nearest (half to even) the exact sum that summed ``limbs`` hold (+0.0 for
    zero): Python's int division rounds correctly, as ``math.fsum`` does, so this is
    ``reducers.exact_sum`` of the ranks' terms. Only the nonzero digits are read (a sum of a few
    ranks' terms fills two or three of the 29), and a result well inside the normal range is
    ``float(int)`` (correctly rounded) scaled by a power of two, which is exact."""
    nz = list(_compress(_DIGITS, limbs))
    if not nz:
        return 0.0
    k0, k1 = nz[0], nz[-1]
    if k1 == k0 + 1:                     # the usual sum: two adjacent digits
        acc = limbs[k0] + (limbs[k1] << LIMB_BITS)
    elif k1 == k0:
        acc = limbs[k0]
    else:
        acc = sum(map(_lshift, limbs[k0:k1 + 1], _SHIFTS))   # the digits from k0 up, in C
    exp, bits = LIMB_BITS * k0 - FRACTION_BITS, abs(acc).bit_length()
    if bits <= 1000 and -1000 <= exp + bits <= 1000:
        # a normal result: float() of an int rounds half to even, and scaling by 2^exp is exact
        return math.ldexp(float(acc), exp) + 0.0
    return (acc << LIMB_BITS * k0) / _SCALE + 0.0    # zero, subnormal or huge: the division


@dataclass(frozen=True)
class ClusterRound:
    """Everything a round's decision and plan read of the cluster, identical on every rank."""

    round: int
    n_req_sum: int
    n_req_max: int
    tokens_max: int
    extend_max: int
    extend_len_max: int
    all_graph: bool
    all_done: bool
    seq_min: int
    any_leave: bool
    prev_n_req_sum: int
    untimed: bool          # some rank's period is < 0
    period_max: float
    pooled: Optional[Pooled]   # the ranks with weight > 0 (None: none)
    values_sum: tuple[int, ...] = ()   # per-request: the ranks' value curves added

    @staticmethod
    def from_matrix(matrix: list[list[float]],
                    pooled: Callable[..., Optional[Pooled]]) -> "ClusterRound":
        """From the gathered vectors; ``pooled(emas, weights, ema_fails)`` is the policy's."""
        c = columns(matrix)
        n_req = [int(v) for v in c["n_req"]]
        tail = [row[len(FIELDS):] for row in matrix]
        values_sum = tuple(sum(int(row[j]) for row in tail) for j in range(len(tail[0])))
        return ClusterRound(
            round=int(c["round"][0]), n_req_sum=sum(n_req), n_req_max=max(n_req),
            tokens_max=int(max(c["num_tokens"])), extend_max=int(max(c["n_extend"])),
            extend_len_max=int(max(c["extend_len"])), all_graph=all(c["can_graph"]),
            all_done=all(c["done"]), seq_min=int(min(c["seq"])), any_leave=any(c["leave"]),
            prev_n_req_sum=int(sum(c["prev_n_req"])), untimed=min(c["period"]) < 0,
            period_max=max(c["period"]) + 0.0,
            pooled=pooled(c["ema"], c["weight"], c["ema_fail"]), values_sum=values_sum)


def _plain_frozen(cls: type, who: str) -> tuple[str, ...]:
    """The field names of ``cls``, a frozen dataclass whose ``__init__`` only sets its fields
    (no ``__post_init__``, no slots); else ``TypeError``."""
    params = getattr(cls, "__dataclass_params__", None)
    if (params is None or not params.frozen or not params.init
            or hasattr(cls, "__post_init__") or hasattr(cls, "__slots__")):
        raise TypeError(f"{who}: {getattr(cls, '__name__', cls)} is not a plain frozen dataclass")
    return tuple(f.name for f in dataclasses.fields(cls))


def frozen_positional(cls: type) -> Callable[..., object]:
    """A constructor of frozen dataclass ``cls`` from every field's value in the fields' order:
    the instance ``cls(*values)`` builds (equal, the same repr and hash), without ``__init__``'s
    one ``object.__setattr__`` per field (a round builds a ``ClusterRound`` and a ``Pooled``).
    Refused for a class whose ``__init__`` does more (``__post_init__``, slots, no init)."""
    names = _plain_frozen(cls, "frozen_positional")
    if {"_frozen_new_", "_frozen_cls_", "_frozen_obj_"} & set(names):
        raise TypeError(f"frozen_positional: {cls.__name__} has a field named as the "
                        f"constructor's own variables")
    # one function with the fields as its parameters and their dict as one constant-keyed
    # display (no zip, no count check: Python's call names a missing or extra value)
    src = (f"def {cls.__name__}({', '.join(names)}):\n"
           f"    _frozen_obj_ = _frozen_new_(_frozen_cls_)\n"
           f"    _frozen_obj_.__dict__.update({{{', '.join(f'{n!r}: {n}' for n in names)}}})\n"
           f"    return _frozen_obj_\n")
    scope = {"_frozen_new_": object.__new__, "_frozen_cls_": cls}
    exec(src, scope)
    make = scope[cls.__name__]
    make.__qualname__ = f"frozen_positional({cls.__name__})"
    return make


def frozen_by_name(cls: type) -> Callable[..., object]:
    """``frozen_positional`` by keyword: every field by name, none missing, none unknown (a
    field added to ``cls`` is a ``TypeError`` naming it at the first call)."""
    names = frozenset(_plain_frozen(cls, "frozen_by_name"))
    new = object.__new__

    def make(**values: object) -> object:
        if values.keys() != names:
            raise TypeError(f"{cls.__name__}: missing {sorted(names - values.keys())}, "
                            f"unknown {sorted(values.keys() - names)}")
        obj = new(cls)
        obj.__dict__.update(values)
        return obj
    return make


_SUM_INTS = ("n_req", "prev_n_req", "weight", "live")
_MAX_INTS = ("n_req", "num_tokens", "n_extend", "extend_len", "no_graph", "not_done",
             "neg_seq", "leave", "untimed", "period", "inexact",
             "ema_max", "neg_ema_min", "rate_max", "neg_rate_min")
_EXACT_TERMS = ("ema_sum", "fail_sum", "rate_sum")   # w·ema, w·ema_fail, w·p: the exact sums
_NO_EXTREMES = (_LOW,) * 4
_N_SUM_INTS = len(_SUM_INTS)
_NO_SIGN = 0x7FFFFFFFFFFFFFFF
_neg = operator.neg
_pack_2d, _unpack_2q = struct.Struct("<2d").pack, struct.Struct("<2q").unpack
_pack_4Q, _unpack_4d = struct.Struct("<4Q").pack, struct.Struct("<4d").unpack
_AGREE_OF = operator.attrgetter(*MUST_AGREE[1:])   # "magic" is the format's, not the vector's
_POOLED_ORDER = ("live", "weight", "ema_sum", "fail_sum", "rate_sum", "ema_min", "ema_max",
                 "rate_min", "rate_max", "mix")   # decode builds a Pooled positionally
if tuple(f.name for f in dataclasses.fields(Pooled)) != _POOLED_ORDER:
    raise ImportError("adaptive_dist.consensus: Pooled's fields moved; ReducedLayout.decode "
                      "builds it positionally in the order " + ", ".join(_POOLED_ORDER))
_CLUSTER_ORDER = ("round", "n_req_sum", "n_req_max", "tokens_max", "extend_max",
                  "extend_len_max", "all_graph", "all_done", "seq_min", "any_leave",
                  "prev_n_req_sum", "untimed", "period_max", "pooled", "values_sum")
if tuple(f.name for f in dataclasses.fields(ClusterRound)) != _CLUSTER_ORDER:
    raise ImportError("adaptive_dist.consensus: ClusterRound's fields moved; "
                      "ReducedLayout.decode builds it positionally in the order "
                      + ", ".join(_CLUSTER_ORDER))
_new_pooled, _new_cluster = frozen_positional(Pooled), frozen_positional(ClusterRound)


class ReducedLayout:
    """The reduced round vector of one configuration (the same on every rank): a SUM part —
    requests, the previous round's requests, weights, live ranks (integers) and, per exact sum
    the reducer reads, ``LIMBS`` fixed-point digits — and a MAX part — the largest batch,
    prefill, prompt; "some rank cannot graph / is not done" (1 − flag), the smallest inbox
    sequence (as −seq), the stop wish, untimed, the longest period; the extreme EMAs and rates
    of ranks with weight (float keys; a minimum as the maximum of the negation); every
    must-agree field and its negation."""

    def __init__(self, needs: Sequence[str], mix_steps: Sequence[int] = (),
                 expected: Optional[Callable[[float, int], float]] = None,
                 n_values: int = 0) -> None:
        self.sums = tuple(n for n in _EXACT_TERMS if n in needs)
        self.mix_steps = tuple(mix_steps) if expected is not None else ()
        self.expected = expected
        n_exact = len(self.sums) + len([s for s in self.mix_steps if s])
        self.n_values = n_values          # a per-request run's value curve: integer sums
        self.values_at = len(_SUM_INTS) + LIMBS * n_exact
        self.n_sum = self.values_at + n_values
        self.n_max = len(_MAX_INTS) + 2 * len(MUST_AGREE)
        self.size = self.n_sum + self.n_max
        self.agree_at = self.n_sum + len(_MAX_INTS)   # must-agree field i: its value, negation
        self._terms = tuple(_EXACT_TERMS.index(n) for n in self.sums)
        self._mixed = tuple(s for s in self.mix_steps if s)
        self.struct = struct.Struct(f"={self.size}q")   # the vector as the int64 buffer's bytes
        self._zeros = [0] * self.size                   # encode copies it: one list a round

    def encode(self, vec: RoundVector) -> list[int]:
        """This rank's contribution (the columns in the order the class docstring gives)."""
        return self.encode_round(
            vec.n_req, vec.num_tokens, vec.n_extend, vec.extend_len, vec.can_graph, vec.done,
            vec.seq, vec.leave, vec.prev_n_req, vec.ema, vec.ema_fail, vec.weight, vec.period,
            _AGREE_OF(vec), vec.values)

    def encode_round(self, n_req: int, num_tokens: int, n_extend: int, extend_len: int,
                     can_graph: bool, done: bool, seq: int, leave: bool, prev_n_req: int,
                     ema: float, ema_fail: float, weight: int, period: float,
                     agree: Sequence[int], values: Sequence[int]) -> list[int]:
        """``encode`` from the round's fields themselves, no ``RoundVector`` built (the
        coordinator's round; a vector is built only on the slow path). ``agree``: the
        must-agree fields after ``magic``, in ``MUST_AGREE``'s order (round, steps, tokens,
        counted, last_switch, config_hash, prev_plan_hash). The same list ``encode`` gives."""
        out = self._zeros[:]
        out[0], out[1], out[2] = n_req, prev_n_req, weight
        ok = True
        if weight > 0:
            out[3] = 1
            den = ema + ema_fail                 # acceptance_rate(e, f), inline
            p = 1.0 if den == 0 else ema / den
            base = _N_SUM_INTS
            for j in self._terms:
                ok = put_fixed(weight * (ema if j == 0 else ema_fail if j == 1 else p),
                               out, base) and ok
                base += LIMBS
            for s in self._mixed:
                ok = put_fixed(weight * self.expected(p, s), out, base) and ok
                base += LIMBS
            ke, kp = _unpack_2q(_pack_2d(ema, p))   # float keys: float_key, two at once
            if ke < 0:
                ke = -(ke & _NO_SIGN)
            if kp < 0:
                kp = -(kp & _NO_SIGN)
            extremes = (ke, -ke, kp, -kp)        # float_key(-x) is -float_key(x): the sign bit
        else:
            extremes = _NO_EXTREMES
        if len(values) != self.n_values:
            raise ValueError(f"round vector: {len(values)} values, the layout has "
                             f"{self.n_values}")
        if values:
            out[self.values_at:self.n_sum] = values
        out[self.n_sum:self.agree_at] = (
            n_req, num_tokens, n_extend, extend_len, int(not can_graph), int(not done), -seq,
            int(leave), int(period < 0), float_key(period) if math.isfinite(period) else _LOW,
            int(not ok)) + extremes
        agree = (REDUCED_MAGIC, *map(int, agree))
        a = self.agree_at
        out[a::2] = agree
        out[a + 1::2] = map(_neg, agree)
        return out

    def agreed(self, red: Sequence[int]) -> bool:
        """Whether every must-agree field had one value (its maximum is minus the maximum of
        its negation) and every sum was exact."""
        a = self.agree_at
        if red[a - 5]:   # inexact
            return False
        return not any(map(operator.add, red[a::2], red[a + 1::2]))

    def decode(self, red: Sequence[int]) -> ClusterRound:
        """The cluster's round from the reduced vector (``agreed`` first)."""
        m = self.n_sum
        live = red[3]
        pooled = None
        if live:
            exact, base = [0.0, 0.0, 0.0], _N_SUM_INTS   # Σw·ema, Σw·ema_fail, Σw·p
            for j in self._terms:
                exact[j] = get_fixed(red[base:base + LIMBS])
                base += LIMBS
            mix = []
            for s in self.mix_steps:
                if s:
                    mix.append((s, get_fixed(red[base:base + LIMBS])))
                    base += LIMBS
                else:
                    mix.append((s, 0.0))
            # the float keys of the extremes back to floats, four at once (key_float's bits)
            k1, k2, k3, k4 = red[m + 11:m + 15]
            e_max, ne_min, p_max, np_min = _unpack_4d(_pack_4Q(
                k1 if k1 >= 0 else -k1 | _SIGN, k2 if k2 >= 0 else -k2 | _SIGN,
                k3 if k3 >= 0 else -k3 | _SIGN, k4 if k4 >= 0 else -k4 | _SIGN))
            pooled = _new_pooled(live, float(red[2]), exact[0], exact[1], exact[2],
                                 -ne_min + 0.0, e_max, -np_min + 0.0, p_max, tuple(mix))
        (n_req_max, tokens_max, extend_max, extend_len_max, no_graph, not_done, neg_seq, leave,
         untimed, period_key) = red[m:m + 10]
        return _new_cluster(
            red[self.agree_at + 2], red[0], n_req_max, tokens_max, extend_max, extend_len_max,
            not no_graph, not not_done, -neg_seq, bool(leave), red[1], bool(untimed),
            key_float(period_key) + 0.0, pooled, tuple(red[self.values_at:m]))


ALGORITHMS = ("auto", "shm", "doubling", "gloo")
TRANSPORT_ENV = "ADAPTIVE_DIST_CONSENSUS_TRANSPORT"
"""Chooses the transport of an ``algorithm="auto"`` channel (one of ``ALGORITHMS``)."""


class ReduceChannel:
    """The reduced round's one collective over ``group``, apart from the model's collectives,
    buffers pre-allocated: ``ops.all_reduce_sum_max`` in host memory.

    ``algorithm``: ``"shm"`` — through a shared-memory segment among the members on one host
    (``collectives.shm``; across hosts, one leader per host exchanges by recursive doubling over
    gloo and publishes to its host); ``"doubling"`` — recursive doubling over the gloo control
    group; ``"gloo"`` — gloo's ring all-reduce twice; ``"auto"`` (the default) — the environment
    variable ``ADAPTIVE_DIST_CONSENSUS_TRANSPORT`` if set, else ``"shm"`` when every member is on
    this host and ``"doubling"`` otherwise. The choice is agreed at construction (a collective
    over the control group); members that asked for different ones are refused by name before
    any exchange. Every transport gives the same integer sums and maxima, bit for bit.
    ``timeout_s``: how long a shared-memory wait may take (default: the control group's)."""

    def __init__(self, group: Group, layout: ReducedLayout, algorithm: str = "auto",
                 timeout_s: Optional[float] = None) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"consensus algorithm={algorithm!r}; allowed: "
                             f"{', '.join(ALGORITHMS)}")
        if algorithm == "auto":
            algorithm = os.environ.get(TRANSPORT_ENV) or "auto"
            if algorithm not in ALGORITHMS:
                raise ValueError(f"{TRANSPORT_ENV}={algorithm!r}; allowed: "
                                 f"{', '.join(ALGORITHMS)}")
        self.group, self.layout = group, layout
        self.buf = torch.zeros(layout.size, dtype=torch.int64)
        self._np = self.buf.numpy()
        self._bytes = memoryview(self._np)   # the same memory: packed and read by one struct
        self._pack_into, self._unpack_from = layout.struct.pack_into, layout.struct.unpack_from
        self.algorithm, self.host = shm.setup(group, layout.size, layout.n_sum, algorithm,
                                              timeout_s)

    def reduce(self, vec: RoundVector) -> list[int]:
        """This rank's vector reduced over the group: the integers, identical on every member."""
        return self.reduce_encoded(self.layout.encode(vec), vec.round)

    def reduce_encoded(self, encoded: list[int], round_: int) -> list[int]:
        """``reduce`` of a vector already encoded (``ReducedLayout.encode_round``) for round
        ``round_`` (named when a field is no int64)."""
        try:
            self._pack_into(self._bytes, 0, *encoded)
        except struct.error as exc:
            raise ValueError(f"round vector of round {round_}: a field is not an integer in "
                             f"int64's range ({exc})") from None
        if self.host is not None:
            self.host.all_reduce_sum_max(self.buf)
        else:
            ops.all_reduce_sum_max(self.buf, self.group, self.layout.n_sum, self.algorithm)
        return list(self._unpack_from(self._bytes))

    def close(self) -> None:
        """Unmap a shared-memory segment (the file itself was unlinked at set-up)."""
        if self.host is not None:
            self.host.close()
