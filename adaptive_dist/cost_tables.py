"""Cost table files: what `--model-costs FILE` reads (`generate`, `serve`, the benchmarks), so a
run decides (and a benchmark prices) on a table measured elsewhere — a GPU's start-up table on a
CPU run — instead of measuring its own at start-up.

A file is either a measured table file (`docs/data/cost_tables/*.json`: milliseconds,
`agreed_round_cost_ms` = `{bucket: {depth: ms}}`, the full chain's round per padded batch bucket
and depth, and for per-request budgets `agreed_verify_cost_ms` = `{tokens: ms}`, the packed
verify forward alone per token count), a results file's `{"agreed_round_cost": ...}` (seconds),
or a bare `round_cost` table (seconds). Errors name the file and the key.
"""
from __future__ import annotations

import json
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional

from adaptive_dist.config import AdaptiveConfig, ConfigError, RoundCost, VerifyCost, is_number


def load_model_costs(value: str) -> tuple[RoundCost, Optional[VerifyCost], Optional[str]]:
    """A JSON table, or a file holding one -> (round cost in seconds, verify cost in seconds or
    None when the file has none, the file's name or None)."""
    path = Path(value)
    name = None
    try:
        if value.lstrip()[:1] not in ("{", "") and path.is_file():
            data, name = json.loads(path.read_text()), str(path)
        else:
            data = json.loads(value)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--model-costs {value!r}: not a JSON file or table ({err.msg} at "
                          f"line {err.lineno})") from None
    except OSError as err:
        raise ConfigError(f"--model-costs {value!r}: cannot be read ({err.strerror})") from None
    verify = None
    where = name or "--model-costs"
    if isinstance(data, dict) and "agreed_round_cost_ms" in data:
        if "agreed_verify_cost_ms" in data:
            verify = VerifyCost.parse({t: c / 1e3 for t, c in
                                       data["agreed_verify_cost_ms"].items()})
        data = {b: {s: c / 1e3 for s, c in row.items()}
                for b, row in data["agreed_round_cost_ms"].items()}
    elif isinstance(data, dict) and "agreed_round_cost" in data:
        if data.get("agreed_verify_cost") is not None:
            verify = VerifyCost.parse(data["agreed_verify_cost"])
        data = data["agreed_round_cost"]
    try:
        return RoundCost.parse(data), verify, name
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def restrict_costs(table: RoundCost, depths: tuple[int, ...]) -> RoundCost:
    """`table` at `depths` only (a goodput policy's table holds exactly its candidates); a
    depth the table lacks is left out, for the config's check to name."""
    keep = set(depths)
    return RoundCost(table.buckets, tuple(tuple((s, c) for s, c in row if s in keep)
                                          for row in table.rows))


def with_model_costs(spec: AdaptiveConfig, value: str) -> AdaptiveConfig:
    """`spec` deciding on the table `value` names (`--model-costs`): its round cost cut to the
    candidates and, with per-request budgets, its verify cost. `ConfigError` naming the flag when
    the policy reads no table, or the file lacks what the run needs."""
    if spec.policy != "goodput":
        raise ConfigError(f"--model-costs applies to --adaptive --policy goodput only (the "
                          f"{spec.policy} policy reads no cost table)")
    table, verify, name = load_model_costs(value)
    missing = sorted(set(spec.candidate_steps) - set(table.steps))
    where = name or "--model-costs"
    if missing:
        raise ConfigError(f"--model-costs {where}: no cost for depth(s) {missing}; the table has "
                          f"{list(table.steps)}, the run's candidates are "
                          f"{list(spec.candidate_steps)}")
    changes = {"round_cost": restrict_costs(table, spec.candidate_steps)}
    if spec.per_request:
        if verify is None:
            raise ConfigError(f"--model-costs {where}: per-request budgets need the verify "
                              f"forward's cost (agreed_verify_cost_ms), which the file lacks")
        changes["verify_cost"] = verify
    return spec.replace(**changes)



# ---- the cost model: a round's price at its context, a prefill's price -----------------------------
#
# Two terms beside the decode table (docs/policy.md, "The cost model"), both optional in a file
# (an older table has neither: it prices decode rounds at the context it was measured at, and
# prefills not at all; `CostModel.unpriced` says which):
#
# - the context term: the packed verify forward measured again with every token's row holding C
#   cached positions (`agreed_verify_cost_ms_at_context` = `{C: {tokens: ms}}`, one or more C).
#   A round whose `n` real verify tokens read `P` KV positions in all costs, beyond its price at
#   context 0, `(v(r, P / n) - v(r, 0)) * n / r` at the rung r holding n (padding tokens read
#   nothing), `v(r, c)` linear between the measured contexts (from 0: the term's own row "0",
#   else the base table) and extended past the last by its last segment. With one C that is `slope(r) * P`, `slope(r) =
#   (v(r, C) - v(r, 0)) / (r * C)` seconds per (token x position). Never below the narrowest
#   rung's extra at the round's longest row (`ContextTerm.floor`): the kernel lasts as long as
#   its longest row's program.
# - the prefill term: a prefill's seconds by the token slots it runs (`prefill_cost_ms` =
#   `{slots: ms}`: the forward's part that follows its token slots), linear between the measured
#   slot counts and past the ends by the nearest segment, plus its attention,
#   `prefill_ms_per_million_positions` x the KV positions it reads (the padded path attends every
#   slot causally: rows x width (width + 1) / 2; the ragged path each prompt's own,
#   `sum len (len + 1) / 2`), the two fitted together from prefills of the same slots at other
#   widths (`fit_prefill`).

# - the catch-up term (cost model version 2): one catch-up forward of the draft cache at depth 0
#   (the head over every row's full lag ring, `catchup_rounds` entries, attending the head's own
#   cache) per padded batch bucket, every row holding C cached positions
#   (`catchup_cost_ms_at_context` = `{C: {bucket: ms}}`), with `catchup_rounds` (the interval the
#   table's depth-0 entries were measured with) and `catchup_table_context` (the cached positions
#   the decode table's rows held; absent: 0, a start-up table's). A depth-0 entry of the decode
#   table holds one catch-up per `catchup_rounds` rounds at that context; a round priced with the term knows whether it ran one: its entry less that share,
#   plus the term at the round's context if it did (`CostModel.round_seconds(catchup=...)`).
#
# Versions (`cost_model_version`, absent: 1). Version 1 files have the decode table and the
# context and prefill terms; version 2 adds the catch-up term. Compatibility: a file without
# `catchup_cost_ms_at_context` (every version-1 table) loads as before and prices catch-ups as
# before, inside the depth-0 entries (one per `catchup_rounds` rounds at the table's context;
# whether a round ran one changes nothing, `unpriced` says so); a file of a version above
# `COST_MODEL_VERSION` is refused by name.

CONTEXT_KEY = "agreed_verify_cost_ms_at_context"
PREFILL_KEY = "prefill_cost_ms"
PREFILL_POSITION_KEY = "prefill_ms_per_million_positions"
CATCHUP_KEY = "catchup_cost_ms_at_context"
CATCHUP_ROUNDS_KEY = "catchup_rounds"
CATCHUP_BASE_KEY = "catchup_table_context"
VERSION_KEY = "cost_model_version"
COST_MODEL_VERSION = 2
"""The cost table format this code reads and writes (1: no catch-up term)."""


def _seconds(row: Any) -> Any:
    """A ``{key: ms}`` object in seconds (anything else as it is, for the parser to name)."""
    if not isinstance(row, dict):
        return row
    return {k: v / 1e3 if is_number(v) else v for k, v in row.items()}


def _rung_costs(row: Any, where: str) -> VerifyCost:
    """``{"<count>": seconds}`` (counts >= 1, seconds > 0) parsed as a ``VerifyCost`` is, its
    errors naming ``where``."""
    try:
        return VerifyCost.parse(row)
    except ConfigError as err:
        raise ConfigError(str(err).replace("verify_cost", where, 1)) from None


def _interp(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear through (xs, ys) (ascending xs), extended past either end by its
    nearest segment; one point: that value."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class ContextTerm:
    """The verify forward's seconds per token rung at one or more cached contexts
    (``costs[i][j]``: context ``contexts[i]``, ``tokens[j]``): from context 0, its own row
    ``"0"`` when it has one (measured in the same process as the others, so a term moved into
    another table keeps its differences), else the base ``VerifyCost``."""

    contexts: tuple[int, ...]
    tokens: tuple[int, ...]
    costs: tuple[tuple[float, ...], ...]

    @staticmethod
    def parse(value: Any, where: str = CONTEXT_KEY) -> "ContextTerm":
        """From ``{"<context>": {"<tokens>": seconds}}``; every context the same rungs."""
        if not isinstance(value, dict) or not value:
            raise ConfigError(f'{where}={value!r}: must be a non-empty object '
                              f'{{"<context>": {{"<tokens>": seconds, ...}}, ...}}')
        rows = {}
        for key, row in value.items():
            if not isinstance(key, str) or not key.isdigit():
                raise ConfigError(f"{where}: key {key!r} must be a context >= 0 written as a "
                                  f"string")
            rows[int(key)] = (row if isinstance(row, VerifyCost)
                              else _rung_costs(row, f"{where}[{key!r}]"))
        contexts = tuple(sorted(rows))
        if contexts == (0,):
            raise ConfigError(f"{where}: only context 0; the term needs a context >= 1")
        tokens = rows[contexts[0]].tokens
        for c in contexts:
            if rows[c].tokens != tokens:
                raise ConfigError(f"{where}[{str(c)!r}]: token counts {list(rows[c].tokens)} "
                                  f"differ from context {contexts[0]}'s {list(tokens)}")
        return ContextTerm(contexts, tokens, tuple(rows[c].costs for c in contexts))

    def to_json(self) -> dict:
        return {str(c): {str(t): v for t, v in zip(self.tokens, row)}
                for c, row in zip(self.contexts, self.costs)}

    def extra(self, base: VerifyCost, tokens: int, positions: float,
              real_tokens: Optional[int] = None, longest: float = 0.0) -> float:
        """Seconds a verify forward at rung ``tokens`` whose ``real_tokens`` (default: all of
        them; padding tokens read nothing) read ``positions`` KV positions in all costs beyond
        its context-0 price: read at the rung that holds the real tokens, ``r``, as ``(v(r, m) -
        v(r, 0)) n / r`` with ``m = positions / n`` their mean context, and never below what the
        term's narrowest rung (one token) costs at ``longest``, the context of the round's
        longest row (`floor`): the attention kernel runs one program per token and KV head, each
        over its own row, so it lasts at least as long as the longest row's program, however
        short the others are (never below 0)."""
        if positions <= 0:
            return 0.0
        if tokens not in self.tokens:
            raise ConfigError(f"{CONTEXT_KEY} has no entry for {tokens} tokens (measured: "
                              f"{list(self.tokens)})")
        n = max(1, min(real_tokens if real_tokens is not None else tokens, tokens))
        rung = next(t for t in self.tokens if t >= n)
        j = self.tokens.index(rung)
        xs, ys = self._points(base, j)
        v0 = ys[0]
        at = _interp(xs, ys, positions / n)
        mean = max(at - v0, 0.0) * n / rung   # noise may measure a context below none
        return max(mean, self.floor(base, longest))

    def floor(self, base: VerifyCost, longest: float) -> float:
        """Seconds the narrowest measured rung (one token where the term has rung 1) adds at
        ``longest`` cached positions over none: the time of one row's attention at that
        context, below which a forward holding such a row cannot go (0 for ``longest <= 0``)."""
        if longest <= 0:
            return 0.0
        xs, ys = self._points(base, 0)
        return max(_interp(xs, ys, float(longest)) - ys[0], 0.0)

    def _points(self, base: VerifyCost, j: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(contexts, seconds) of rung ``j`` from context 0: the term's own row 0 when it has
        one (measured with the others, in one process), else the base table's."""
        xs = tuple(float(c) for c in self.contexts)
        ys = tuple(row[j] for row in self.costs)
        if self.contexts[0] == 0:
            return xs, ys
        return (0.0,) + xs, (base.cost(self.tokens[j]),) + ys

    def slope(self, base: VerifyCost, tokens: int) -> float:
        """Seconds per (token x position) at rung ``tokens`` over the first context > 0."""
        xs, ys = self._points(base, self.tokens.index(tokens))
        return (ys[1] - ys[0]) / (tokens * xs[1])


@dataclass(frozen=True)
class PrefillTerm:
    """A prefill's seconds: ``costs`` at each measured token-slot count ``slots`` (the forward's
    linear part) and ``per_position`` seconds per KV position its prompts' attention reads
    (None: the attention not priced)."""

    slots: tuple[int, ...]
    costs: tuple[float, ...]
    per_position: Optional[float] = None

    @staticmethod
    def parse(value: Any, per_million_ms: Any = None) -> "PrefillTerm":
        """From the file's ``prefill_cost_ms`` (``{"<slots>": ms}``) and
        ``prefill_ms_per_million_positions``."""
        ms = _rung_costs(value, PREFILL_KEY)   # named in the file's unit
        pairs = VerifyCost(ms.tokens, tuple(c / 1e3 for c in ms.costs))
        per = None
        if per_million_ms is not None:
            if not is_number(per_million_ms) or per_million_ms < 0:
                raise ConfigError(f"{PREFILL_POSITION_KEY}={per_million_ms!r}: must be a "
                                  f"number >= 0 (ms per million positions)")
            per = per_million_ms / 1e9
        return PrefillTerm(pairs.tokens, pairs.costs, per)

    def to_json(self) -> dict:
        out = {PREFILL_KEY: {str(s): 1e3 * c for s, c in zip(self.slots, self.costs)}}
        if self.per_position is not None:
            out[PREFILL_POSITION_KEY] = 1e9 * self.per_position
        return out

    def cost(self, slots: int, positions: float = 0.0) -> float:
        """Seconds of a prefill of ``slots`` token slots whose prompts read ``positions``."""
        linear = _interp(tuple(map(float, self.slots)), self.costs, float(slots))
        linear = max(linear, min(self.costs))
        return linear + (self.per_position or 0.0) * positions


def causal_positions(lengths: Any) -> int:
    """KV positions a prefill of prompts of ``lengths`` reads (each token its prefix and
    itself)."""
    return sum(n * (n + 1) // 2 for n in lengths)


def fit_prefill(samples: Any) -> PrefillTerm:
    """The prefill term from measurements ``(slots, positions, seconds)``: seconds = B(slots) +
    c * positions, B linear between knots (each measured slot count's sample at the fewest
    positions), c by least squares over the other samples (a sample's B read from the knots
    around it, each knot's seconds less c times its positions: closed form); None without a
    sample off the knots, held at >= 0. The knots' costs are stored with their attention taken
    out (``t_k - c p_k``)."""
    pts = [(int(s), float(p), float(t)) for s, p, t in samples]
    if not pts:
        raise ValueError("fit_prefill: no samples")
    knots: dict[int, tuple[float, float]] = {}
    for s, p, t in pts:
        if s not in knots or p < knots[s][0]:
            knots[s] = (p, t)
    keys = tuple(sorted(knots))
    xs = tuple(float(k) for k in keys)

    def weights(slots: float) -> list[float]:
        """B(slots) = sum w_k B_k (`_interp`'s weights)."""
        return [_interp(xs, tuple(1.0 if i == k else 0.0 for i in range(len(keys))), slots)
                for k in range(len(keys))]
    num = den = 0.0
    for s, p, t in pts:
        if knots[s] == (p, t):
            continue
        w = weights(float(s))
        y = t - sum(wk * knots[k][1] for wk, k in zip(w, keys))
        x = p - sum(wk * knots[k][0] for wk, k in zip(w, keys))
        num, den = num + x * y, den + x * x
    per = max(num / den, 0.0) if den else None
    c = per or 0.0
    return PrefillTerm(keys, tuple(max(knots[k][1] - c * knots[k][0], 1e-9) for k in keys), per)


@dataclass(frozen=True)
class CatchupTerm:
    """Seconds of one catch-up forward (the head over every row's full lag ring) per padded
    batch bucket at one or more cached contexts (``costs[i][j]``: context ``contexts[i]``,
    bucket ``buckets[j]``); ``every``: the catch-up interval the decode table's depth-0 entries
    were measured with (each holds one catch-up per ``every`` rounds), at ``base_context``
    cached positions (the file's ``catchup_table_context``)."""

    contexts: tuple[int, ...]
    buckets: tuple[int, ...]
    costs: tuple[tuple[float, ...], ...]
    every: int
    base_context: int = 0

    @staticmethod
    def parse(value: Any, every: Any, base_context: Any = 0) -> "CatchupTerm":
        """From the file's ``catchup_cost_ms_at_context`` (``{"<context>": {"<bucket>": ms}}``,
        every context the same buckets), ``catchup_rounds`` and ``catchup_table_context``."""
        if not isinstance(value, dict) or not value:
            raise ConfigError(f'{CATCHUP_KEY}={value!r}: must be a non-empty object '
                              f'{{"<context>": {{"<bucket>": ms, ...}}, ...}}')
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"{CATCHUP_ROUNDS_KEY}={every!r}: the catch-up term needs the "
                              f"interval its table's depth-0 entries were measured with (an "
                              f"integer >= 1)")
        if base_context is None:
            base_context = 0
        if not isinstance(base_context, int) or isinstance(base_context, bool) \
                or base_context < 0:
            raise ConfigError(f"{CATCHUP_BASE_KEY}={base_context!r}: must be an integer >= 0 "
                              f"(the cached positions the decode table was measured at)")
        rows = {}
        for key, row in value.items():
            if not isinstance(key, str) or not key.isdigit():
                raise ConfigError(f"{CATCHUP_KEY}: key {key!r} must be a context >= 0 written "
                                  f"as a string")
            ms = _rung_costs(row, f"{CATCHUP_KEY}[{key!r}]")   # counts >= 1, costs > 0
            rows[int(key)] = ms
        contexts = tuple(sorted(rows))
        buckets = rows[contexts[0]].tokens
        for c in contexts:
            if rows[c].tokens != buckets:
                raise ConfigError(f"{CATCHUP_KEY}[{str(c)!r}]: buckets {list(rows[c].tokens)} "
                                  f"differ from context {contexts[0]}'s {list(buckets)}")
        return CatchupTerm(contexts, buckets,
                           tuple(tuple(ms / 1e3 for ms in rows[c].costs) for c in contexts),
                           every, base_context)

    def to_json(self) -> dict:
        """The file's keys (milliseconds)."""
        return {CATCHUP_KEY: {str(c): {str(b): 1e3 * v for b, v in zip(self.buckets, row)}
                              for c, row in zip(self.contexts, self.costs)},
                CATCHUP_ROUNDS_KEY: self.every, CATCHUP_BASE_KEY: self.base_context}

    def cost(self, batch: int, context: float) -> float:
        """Seconds of one catch-up at padded batch ``batch`` (the smallest measured bucket
        holding it; past the largest, the largest) whose rows hold ``context`` cached positions:
        linear between the measured contexts, past either end by the nearest segment (one
        context: that value), never below the lowest measured context's price."""
        j = next((i for i, b in enumerate(self.buckets) if b >= batch), len(self.buckets) - 1)
        ys = tuple(row[j] for row in self.costs)
        at = _interp(tuple(float(c) for c in self.contexts), ys, float(context))
        return max(at, ys[0])

    def share(self, batch: int) -> float:
        """What a depth-0 entry of the decode table holds of catch-ups per round: one at the
        table's context per ``every`` rounds."""
        return self.cost(batch, self.base_context) / self.every


@dataclass(frozen=True)
class CostModel:
    """What a cost table file prices: decode rounds (``round_cost``, with ``verify_cost`` by
    their own verify tokens), the context their attention reads (``context``) and prefills
    (``prefill``); a term the file lacks is None and ``unpriced`` names it."""

    round_cost: RoundCost
    verify_cost: Optional[VerifyCost] = None
    context: Optional[ContextTerm] = None
    prefill: Optional[PrefillTerm] = None
    name: Optional[str] = None
    catchup: Optional[CatchupTerm] = None

    def unpriced(self) -> list[str]:
        """The terms this model does not price, for reports."""
        out = []
        if self.context is None:
            out.append("context (decode rounds priced as the base table's rows read: no "
                       "cached positions)")
        if self.prefill is None:
            out.append("prefill (prefills priced at 0)")
        if self.catchup is None:
            out.append("catch-up (depth-0 rounds priced with the table's share of catch-ups at "
                       "its context, whether a round ran one or not)")
        return out

    def round_seconds(self, steps: int, tokens: int, batch: int, positions: float = 0.0,
                      real_tokens: Optional[int] = None, longest: float = 0.0,
                      catchup: Optional[bool] = None,
                      catchup_context: Optional[float] = None) -> float:
        """Seconds of a decode round of ``steps`` draft forwards and ``tokens`` verify tokens
        (a rung) at padded batch ``batch`` whose ``real_tokens`` read ``positions`` KV
        positions, the longest row ``longest`` of them (the context term where the model has
        one, `ContextTerm.extra`; else the base price). ``catchup`` (None: not known, the
        table's price) whether a catch-up of the draft cache ran in the round: with the
        catch-up term a depth-0 round is priced without the table's share of catch-ups
        (`CatchupTerm.share`) and a round that ran one adds `catchup_seconds` at
        ``catchup_context`` (default the round's longest row, else its mean context); without
        the term ``catchup`` changes nothing."""
        from adaptive_dist.policy.budgets import shape_cost
        from adaptive_dist.policy.goodput import cost_row
        from adaptive_dist.shape import token_bucket

        if self.verify_cost is not None:
            price = shape_cost(self.round_cost, self.verify_cost, steps, tokens, batch)
        else:
            price = dict(self.round_cost.rows[cost_row(self.round_cost, batch)])[steps]
        if self.context is not None and self.verify_cost is not None and positions > 0:
            rung = token_bucket(tokens, self.context.tokens)
            price += self.context.extra(self.verify_cost, rung, positions, real_tokens, longest)
        if catchup is not None and self.catchup is not None:
            if steps == 0:
                price -= self.catchup.share(batch)
            if catchup:
                if catchup_context is None:
                    n = real_tokens if real_tokens is not None else tokens
                    catchup_context = longest or (positions / n if n else 0.0)
                price += self.catchup_seconds(batch, catchup_context)
        return price

    def catchup_seconds(self, batch: int, context: float = 0.0) -> float:
        """Seconds of one catch-up of the draft cache at padded batch ``batch``, its rows at
        ``context`` cached positions (0.0 when the model has no catch-up term: the table's
        depth-0 entries hold them, see ``unpriced``)."""
        return self.catchup.cost(batch, context) if self.catchup is not None else 0.0

    def prefill_seconds(self, slots: int, positions: float = 0.0) -> float:
        """Seconds of a prefill (0.0 when the model prices none: see ``unpriced``)."""
        return self.prefill.cost(slots, positions) if self.prefill is not None else 0.0


def cost_model(value: str) -> CostModel:
    """`load_model_costs` with the context and prefill terms of a table file (absent keys:
    those terms None). ``ConfigError`` naming the file and the key."""
    table, verify, name = load_model_costs(value)
    path = Path(value)
    data = json.loads(path.read_text()) if name is not None else json.loads(value)
    where = name or "--model-costs"
    context = prefill = catchup = None
    if not isinstance(data, dict):
        return CostModel(table, verify, name=name)
    try:
        version = data.get(VERSION_KEY, 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ConfigError(f"{VERSION_KEY}={version!r}: must be an integer >= 1")
        if version > COST_MODEL_VERSION:
            raise ConfigError(f"{VERSION_KEY}={version}: this code reads cost tables up to "
                              f"version {COST_MODEL_VERSION}")
        if data.get(CATCHUP_KEY) is not None:
            if version < 2:
                raise ConfigError(f"{CATCHUP_KEY} is a version-2 term; the file says "
                                  f"{VERSION_KEY} {version}")
            catchup = CatchupTerm.parse(data[CATCHUP_KEY], data.get(CATCHUP_ROUNDS_KEY),
                                        data.get(CATCHUP_BASE_KEY, 0))
        if data.get(CONTEXT_KEY) is not None:
            raw = data[CONTEXT_KEY]
            context = ContextTerm.parse({c: _seconds(row) for c, row in raw.items()}
                                        if isinstance(raw, dict) else raw)
            if verify is None:
                raise ConfigError(f"{CONTEXT_KEY} needs agreed_verify_cost_ms (its context-0 "
                                  f"base)")
            missing = [t for t in context.tokens if t not in verify.tokens]
            if missing and context.contexts[0] != 0:
                raise ConfigError(f"{CONTEXT_KEY}: token counts {missing} have no context-0 "
                                  f"cost in agreed_verify_cost_ms")
        if data.get(PREFILL_KEY) is not None:
            prefill = PrefillTerm.parse(data[PREFILL_KEY], data.get(PREFILL_POSITION_KEY))
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return CostModel(table, verify, context, prefill, name, catchup)


def price_round_log(records: Any, model: CostModel, rank: int = 0) -> list[float]:
    """Seconds `model` prices each of `rank`'s lines of a round log (`--round-log`, read by
    `workers.round_log.read_round_log`) at, in file order: a decode line as a round of its
    `draft_forwards` and `padded_tokens` (the model's verify rung holding them) at the batch of
    its requests (the bucket holding them),
    with its catch-up (`catchup`, at its `longest` request's context; a line without the key,
    written before it existed, at the table's price); a prefill line as a prefill of its
    `padded_tokens` token slots, its attention not priced (the log does not hold the prompts'
    lengths)."""
    out = []
    for rec in records:
        if rec.get("rank", 0) != rank:
            continue
        if rec["kind"] == "prefill":
            out.append(model.prefill_seconds(int(rec["padded_tokens"])))
            continue
        batch = max(1, len(rec["requests"]))
        tokens = int(rec["padded_tokens"])
        if model.verify_cost is not None:
            from adaptive_dist.shape import token_bucket

            tokens = token_bucket(tokens, model.verify_cost.tokens)
        out.append(model.round_seconds(int(rec["draft_forwards"]), tokens,
                                       batch, catchup=rec.get("catchup"),
                                       catchup_context=float(rec.get("longest", 0))))
    return out
