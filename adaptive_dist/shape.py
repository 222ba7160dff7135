"""The shape of a speculative round: what every rank of the cluster must run alike.

A round drafts and verifies. What its collectives depend on — and so what the ranks agree — is
``RoundShape``: the number of sequential draft forwards ``S`` (each a head forward over the
round's padded batch, with the same collectives on every rank) and the verify forward's padded
token count ``T`` (its collectives move ``T`` tokens per rank). Inside that shape each request
drafts its own number of tokens ``d_i <= S`` and verifies ``d_i + 1`` of them; a rank packs its
requests' verify tokens back to back, ``sum(d_i + 1) <= T``, and pads the rest. A chain of depth
``S`` for every request is the shape ``(S, sum(S + 1))``; depth 0 is ``S = 0``, one verify token
per request.

A round may instead be a draft tree (``TreeShape``: steps S, top-k K, N verify tokens per
request, the root included): every request drafts the tree and verifies N tokens, so the verify
forward runs ``rows * N`` tokens; top-k 1 is the chain.

``T`` comes from ``TOKEN_LADDER``: powers of two and 1.5 times powers of two, so a padded verify
costs at most 1.5x its real tokens, every full chain ``batch bucket x (S + 1)`` with a
power-of-two bucket and ``S + 1`` a power of two is on it exactly, and the engine captures one
target-forward graph per rung. Nothing here knows about models.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, order=True)
class RoundShape:
    """What a round runs on every rank: ``draft_forwards`` (S) sequential head forwards over the
    padded batch, then one target forward over ``verify_tokens`` (T) packed, padded tokens."""

    draft_forwards: int
    verify_tokens: int
    topk: int = 1
    """A draft tree's top-k (``TreeShape``); 1: a chain."""
    tree_tokens: int = 0
    """A draft tree's verify tokens per request N, the root included (0: a chain)."""

    def __post_init__(self) -> None:
        if self.draft_forwards < 0 or self.verify_tokens < 0:
            raise ValueError(f"RoundShape({self.draft_forwards}, {self.verify_tokens}): both "
                             f"must be >= 0")
        if self.topk > 1:
            TreeShape(self.draft_forwards, self.topk, self.tree_tokens)
        elif self.tree_tokens:
            raise ValueError(f"RoundShape: tree_tokens={self.tree_tokens} needs topk > 1")

    @property
    def tree(self) -> "TreeShape | None":
        """The draft tree of a tree round (None: a chain)."""
        return (TreeShape(self.draft_forwards, self.topk, self.tree_tokens) if self.topk > 1
                else None)

    @property
    def width(self) -> int:
        """Verify positions a request may use: its draft tokens and the bonus (``S + 1``)."""
        return self.draft_forwards + 1

    def fits(self, budgets: Sequence[int]) -> bool:
        """Whether requests drafting ``budgets`` tokens each fit the shape (``d_i <= S`` and
        ``sum(d_i + 1) <= T``)."""
        if self.topk > 1:   # a tree: every request its whole tree of N tokens
            return (all(d == self.draft_forwards for d in budgets)
                    and len(budgets) * self.tree_tokens <= self.verify_tokens)
        return (all(0 <= d <= self.draft_forwards for d in budgets)
                and sum(budgets) + len(budgets) <= self.verify_tokens)

    def to_json(self) -> dict:
        out = {"draft_forwards": self.draft_forwards, "verify_tokens": self.verify_tokens}
        if self.topk > 1:
            out.update(topk=self.topk, tree_tokens=self.tree_tokens)
        return out


@dataclass(frozen=True)
class TreeShape:
    """An EAGLE-2 draft tree: ``steps`` (S) draft steps, each expanding the ``topk`` (K) most
    likely children of the K best frontier nodes by cumulative draft log-probability; the
    request then verifies ``tokens`` (N) tokens: its last committed token (the root) and the
    N - 1 best of the tree's ``nodes`` (K + (S - 1) K^2). ``K = 1`` is the chain of depth S
    (N = S + 1). The verify forward of a round over ``B`` padded rows runs ``B * N`` tokens."""

    steps: int
    topk: int
    tokens: int

    def __post_init__(self) -> None:
        if self.steps < 1 or self.topk < 1:
            raise ValueError(f"a draft tree needs --steps >= 1 and --speculative-eagle-topk >= "
                             f"1, not steps {self.steps}, top-k {self.topk}")
        if not 2 <= self.tokens <= self.nodes + 1:
            raise ValueError(f"--speculative-num-draft-tokens {self.tokens}: a tree of "
                             f"{self.steps} steps at top-k {self.topk} has {self.nodes} nodes, "
                             f"so it verifies 2 .. {self.nodes + 1} tokens (the root included)")

    @property
    def nodes(self) -> int:
        """The tree's draft nodes: K at the first step, K^2 candidates at each later one."""
        return self.topk + (self.steps - 1) * self.topk * self.topk

    def round_shape(self, rows: int) -> RoundShape:
        """The round over ``rows`` padded rows: S draft forwards, ``rows * N`` verify tokens."""
        return RoundShape(self.steps, rows * self.tokens, self.topk, self.tokens)


def token_ladder(top: int) -> tuple[int, ...]:
    """The verify-token buckets up to the first rung that holds ``top`` tokens: 1, 2, 3, 4, 6,
    8, 12, 16, 24, ... (every power of two p and 3p/2)."""
    if top < 1:
        raise ValueError(f"token_ladder: top={top} must be >= 1")
    out, p = [1], 2
    while out[-1] < top:
        out.append(p)
        if p >= 2 and out[-1] < top:
            out.append(p + p // 2)
        p *= 2
    return tuple(x for i, x in enumerate(out) if i == 0 or x > out[i - 1])


def token_bucket(tokens: int, ladder: Sequence[int]) -> int:
    """The smallest rung of ``ladder`` holding ``tokens`` (the largest rung when none does:
    callers size the ladder so that it never happens)."""
    for t in ladder:
        if t >= tokens:
            return t
    return ladder[-1]


def chain_shape(depth: int, requests: int, ladder: Sequence[int]) -> RoundShape:
    """Every one of ``requests`` (the cluster's largest batch) drafting ``depth`` tokens."""
    return RoundShape(depth, token_bucket(max(requests, 1) * (depth + 1), ladder))
