"""A round that drafts a tree (EAGLE-2) instead of a chain: draft, verify, accept, commit.

At shape `TreeShape(S, K, N)` over `Bp` padded rows (request `b` in slot `rows[b]`, context `n`,
last token `x_n`, head feature `g_n`), on the device, with no host synchronisation:

1. draft: step 1 takes the K most likely tokens of the head's distribution at `g_n` (the tree's
   first level; a node's score is its cumulative draft log-probability). Each step k = 2..S runs
   the head once over the frontier's K nodes (depth k-1, position n + k - 1, the feature the
   head output that proposed the node), each attending to the draft context and its ancestors
   (`workers.attention.tree`; the nodes' K/V stay in a per-round store, never in the pages);
   every frontier node proposes its K most likely children (K^2 candidates, all added to the
   tree) and the K best candidates by score become the next frontier. The tree then holds
   `K + (S-1) K^2` nodes, numbered in creation order (a parent before its children).
2. select: the N-1 best nodes by score (a stable sort: a child never scores above its parent,
   and on a tie the parent comes first, so the set is closed under ancestors), in creation
   order, after the root `x_n`: ancestors before descendants. The tree mask of the N tokens
   follows from their parents (each sees itself and its ancestors).
3. verify: one target forward over the `Bp * N` tokens, positions n + depth, the tree mask.
4. accept: greedy — from the root, follow the child whose token equals the target's argmax at
   the node, as long as one does; the bonus is the argmax at the last node. Sampling — lossless
   multi-branch rejection: at a node with target distribution p (the request's temperature and
   top-p), try its children in order (most likely draft first): accept child c with probability
   r(c) / sum(r) for the residual r (p with the children rejected so far zeroed); when every
   child is rejected (or the node has none) the final token is drawn from r. Each committed
   token is so distributed exactly as the target's (the drafts are deterministic: q = one-hot).
5. commit: the accepted path's target K/V go to positions n .. n+a of the pages; the chain's
   draft-extend then runs the head over the path's tokens with their target features (window
   rows 0..a of the round's buffers), which rewrites the draft cache there, and the slots
   advance (`RoundPhases.extend_phase`).

Every rank of a DP cluster runs the same forwards with the same row counts (`Bp * K` per draft
step, `Bp * N` in verify), whatever its trees hold.

Per-request trees (``--per-request`` with tree candidates; `run(..., tokens=T)`): row `b`
verifies its `N_b` best nodes (`budget[b]`, 0 .. N - 1; the host's fill, `policy.tree`) — the
first `N_b` of the same best-first order, so a subtree — and the verify forward runs the agreed
`T` packed tokens: every row's root and kept nodes back to back in creation order, padded to `T`
(`workers.attention.tree.PackedTreeAttention`). A node left out is its own parent (no one's
child: the walk never reaches it). The drafting is the same at every `N_b` (`Bp * K` rows per
step); `N_b = 0` verifies the root alone (the bonus token).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adaptive_dist.shape import TreeShape
from workers.attention.tree import PackedTreeAttention, TreeAttention, TreeKV, commit
from workers.spec_decode import SALT_ACCEPT, SALT_BONUS, probs, sample_from, uniforms
from workers.worker.models import RankModels
from workers.worker.slots import SlotState, StepBuffers


@dataclass
class Tree:
    """The verify set of a round's trees: N tokens per row, the root first, in creation order."""

    tokens: torch.Tensor   # [Bp, N] the tokens (x_n first)
    parent: torch.Tensor   # [Bp, N] each token's parent (the root its own)
    depth: torch.Tensor    # [Bp, N] 0 for the root
    mask: torch.Tensor     # [Bp, N, N] bool: token i sees token j (j an ancestor of i, or i)
    live: torch.Tensor | None = None   # [Bp, N] bool: verified (per-request trees; None: all)


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """The head's log-probabilities in float32 (never above 0: a child never outscores its
    parent)."""
    return torch.log_softmax(logits.float(), dim=-1).clamp(max=0.0)


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` best of each row, best first; ties to the earlier index."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]


def ancestors(parent: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, N, N] bool: token j is token i or one of its ancestors (`parent` [B, N], the root its
    own parent; no path is longer than `depth`)."""
    b, n = parent.shape
    cur = torch.arange(n, device=parent.device).expand(b, n).contiguous()
    mask = torch.zeros(b, n, n, dtype=torch.bool, device=parent.device)
    for _ in range(depth + 1):
        mask.scatter_(2, cur[:, :, None], True)
        cur = parent.gather(1, cur)
    return mask


class TreeRound:
    """The draft, verify and acceptance of a tree round (see the module docstring)."""

    def __init__(self, tree: TreeShape, slots: SlotState, models: RankModels) -> None:
        self.tree, self.slots, self.models = tree, slots, models

    def run(self, bufs: StepBuffers, bp: int, reach: int, greedy: bool,
            tokens: int | None = None) -> None:
        """Draft, verify and accept over the round's first `bp` rows; fill `bufs` as the
        chain's acceptance does (accepted lengths, committed tokens, the path's target
        features) and commit the path's target K/V. Draft-extend follows (the chain's).
        `tokens`: a per-request tree round's packed verify tokens T (each row its
        `bufs.budget` best nodes); None: every row its N tokens."""
        rows = bufs.rows[:bp]
        n, real = self.slots.row_state(rows)
        pages = self.slots.pages_of(rows, reach)
        budget = bufs.budget[:bp] if tokens is not None else None
        tree = self.draft(rows, n, pages, budget)
        if tokens is None:
            hidden, logits, memory = self.verify(tree, n, pages)
        else:
            hidden, logits, memory = self.verify_packed(tree, n, pages, real, tokens)
        if greedy:
            accept, path, tokens = self.accept_greedy(tree, logits.argmax(-1), real)
        else:
            temp, top_p, seed = self.slots.sampling(rows)
            accept, path, tokens = self.accept_sampled(tree, logits, real, temp, top_p, seed, n)
        width = self.tree.steps + 1
        commit(self.models.target_kv, memory, pages, n, path, (accept + 1) * real)
        feature = hidden.shape[-1]
        bufs.hidden[:bp * width] = hidden.view(bp, -1, feature).gather(
            1, path[:, :, None].expand(-1, -1, feature)).reshape(bp * width, feature)
        bufs.accept[:bp] = accept * real
        bufs.tokens[:bp] = tokens
        bufs.out[:bp, 0] = self.slots.last_token[rows]

    # ---- draft -------------------------------------------------------------------------------
    def draft(self, rows: torch.Tensor, n: torch.Tensor, pages: torch.Tensor,
              budget: torch.Tensor | None = None) -> Tree:
        """The tree of every row and its N-token verify set (steps 1 and 2 of the docstring).

        Per step only what changes with the step runs on the device (the head, its top-k, the
        frontier's choice and four gathers): a node's mask row is its parent's row with the
        node's own slot set, the parents and depths of every step's candidates are laid out
        once after the loop (`_draft_reference` in the tests: the one-op-per-quantity form it
        equals)."""
        steps, k, tokens = self.tree.steps, self.tree.topk, self.tree.tokens
        models, bp, device = self.models, rows.shape[0], rows.device
        head = models.head
        g = self.slots.feature[rows]
        score, token = _log_probs(head.compute_logits(g)).topk(k, dim=-1)        # [Bp, K]
        scores, toks, frontier_ids = [score], [token], []
        ids = torch.arange(k, device=device).expand(bp, k)
        feat = g[:, None, :].expand(bp, k, g.shape[-1])
        slots = (steps - 1) * k
        memory = None
        if steps > 1:
            pool = models.draft_kv
            memory = TreeKV(len(pool.k), bp, slots, pool.num_kv_heads, head.config.head_dim,
                            g.dtype, device)
            # own[s, i, j]: frontier position i of step s + 2 is tree slot j (one op per round)
            slot = torch.arange(slots, device=device)
            own = (slot.view(steps - 1, k, 1) == slot[None, None, :])
            anc = torch.zeros(bp, k, slots, dtype=torch.bool, device=device)   # ancestors' slots
            pos = n[:, None].expand(bp, k).reshape(-1)                          # [Bp*K]
        for step in range(2, steps + 1):
            start = (step - 2) * k
            mask = anc | own[step - 2]                       # itself and its ancestors
            attn = TreeAttention(models.draft_kv, pages, n, memory, start, mask)
            out = head(token.reshape(-1), feat.reshape(bp * k, -1), pos + (step - 1), attn)
            lp, child = _log_probs(head.compute_logits(out)).topk(k, dim=-1)        # [Bp*K, K]
            cand = (score[:, :, None] + lp.view(bp, k, k)).reshape(bp, k * k)
            scores.append(cand)
            toks.append(child.view(bp, k * k))
            frontier_ids.append(ids)
            best = _top(cand, k)                                                   # [Bp, K]
            origin = best // k                           # the frontier position of the parent
            ids = (k + (step - 2) * k * k) + best
            score = cand.gather(1, best)
            token = child.view(bp, k * k).gather(1, best)
            feat = out.view(bp, k, -1).gather(1, origin[:, :, None].expand(-1, -1, out.shape[-1]))
            anc = mask.gather(1, origin[:, :, None].expand(-1, -1, slots))   # the parent's row
        # step s's K^2 candidates: parent = the frontier id of position c // K, depth s
        parents = [torch.full_like(toks[0], -1)]
        node = torch.arange(k + (steps - 1) * k * k, device=device)
        depths = 1 + (node + (k * k - k)) // (k * k)       # 1 for the first K, then K^2 each
        if frontier_ids:
            parents.append(torch.stack(frontier_ids, 1)[:, :, :, None].expand(
                bp, steps - 1, k, k).reshape(bp, -1))
        return self.select(rows, torch.cat(scores, 1), torch.cat(toks, 1),
                           torch.cat(parents, 1), depths[None, :].expand(bp, -1), budget)

    def select(self, rows: torch.Tensor, score: torch.Tensor, token: torch.Tensor,
               parent: torch.Tensor, depth: torch.Tensor,
               budget: torch.Tensor | None = None) -> Tree:
        """The root and the N-1 best nodes, in creation order, with their tree mask; with
        `budget` [Bp] each row's first `budget[b]` of them by score are live (the rest are
        their own parents: nobody's child, seeing themselves alone)."""
        bp, device, n = rows.shape[0], rows.device, self.tree.tokens
        chosen, rank = _top(score, n - 1).sort(dim=1)          # [Bp, N-1], rank: best-first
        verify_index = torch.zeros_like(score, dtype=torch.int64)
        verify_index.scatter_(1, chosen, torch.arange(1, n, device=device).expand(bp, n - 1))
        up = parent.gather(1, chosen)
        up = torch.where(up < 0, torch.zeros_like(up), verify_index.gather(1, up.clamp(min=0)))
        zero = torch.zeros(bp, 1, dtype=torch.int64, device=device)
        parent_v = torch.cat([zero, up], 1)
        live = None
        if budget is not None:
            live = torch.cat([torch.ones_like(zero, dtype=torch.bool),
                              rank < budget[:, None]], 1)
            parent_v = torch.where(live, parent_v, torch.arange(n, device=device)[None, :])
        return Tree(tokens=torch.cat([self.slots.last_token[rows][:, None],
                                      token.gather(1, chosen)], 1),
                    parent=parent_v, depth=torch.cat([zero, depth.gather(1, chosen)], 1),
                    mask=ancestors(parent_v, self.tree.steps), live=live)

    # ---- verify and accept -------------------------------------------------------------------
    def verify(self, tree: Tree, n: torch.Tensor, pages: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, TreeKV]:
        """The target over every row's N tokens: (features [Bp*N, F], logits [Bp, N, V], the
        tokens' K/V)."""
        models = self.models
        pool, target = models.target_kv, models.target
        bp, count = tree.tokens.shape
        dtype = next(target.parameters()).dtype
        memory = TreeKV(len(pool.k), bp, count, pool.num_kv_heads, target.config.head_dim,
                        dtype, tree.tokens.device)
        attn = TreeAttention(pool, pages, n, memory, 0, tree.mask)
        hidden = target(tree.tokens.reshape(-1), (n[:, None] + tree.depth).reshape(-1), attn)
        logits = target.compute_logits(hidden)
        return hidden, logits.view(bp, count, -1), memory

    def verify_packed(self, tree: Tree, n: torch.Tensor, pages: torch.Tensor,
                      real: torch.Tensor, tokens: int
                      ) -> tuple[torch.Tensor, torch.Tensor, TreeKV]:
        """The target over `tokens` packed tokens: every real row's live nodes back to back (in
        creation order), the rest padding -> (features and logits on the `[Bp, N]` grid, the
        nodes' K/V; a node not verified: zeros). A live node past `tokens` (the host's fill
        never leaves one) is dropped with its descendants (they come after it)."""
        models = self.models
        pool, target = models.target_kv, models.target
        bp, count = tree.tokens.shape
        device, cells = tree.tokens.device, bp * count
        live = tree.live & (real[:, None] > 0)
        per_row = live.to(torch.int64).sum(1)
        dest = (per_row.cumsum(0) - per_row)[:, None] + live.to(torch.int64).cumsum(1) - 1
        live = live & (dest < tokens)
        tree.live = live
        tree.parent = torch.where(live, tree.parent, torch.arange(count, device=device)[None, :])
        dest = torch.where(live, dest, torch.full_like(dest, tokens)).reshape(-1)
        grid = torch.full((tokens + 1,), cells, dtype=torch.int64, device=device)
        grid.scatter_(0, dest, torch.arange(cells, device=device))   # padding: row Bp, slot 0
        grid = grid[:tokens]
        pad = torch.zeros(1, dtype=torch.int64, device=device)
        ids = torch.cat([tree.tokens.reshape(-1), pad])[grid]
        pos = torch.cat([(n[:, None] + tree.depth).reshape(-1), pad])[grid]
        dtype = next(target.parameters()).dtype
        memory = TreeKV(len(pool.k), bp + 1, count, pool.num_kv_heads, target.config.head_dim,
                        dtype, device)
        attn = PackedTreeAttention(pool, pages, n, memory, tree.mask, grid, live)
        hidden = target(ids, pos, attn)
        logits = target.compute_logits(hidden)
        hidden_g = hidden.new_zeros((cells + 1, hidden.shape[-1]))
        hidden_g[grid] = hidden
        logits_g = logits.new_zeros((cells + 1, logits.shape[-1]))
        logits_g[grid] = logits
        return hidden_g[:cells], logits_g[:cells].view(bp, count, -1), memory

    def _children(self, tree: Tree, node: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first K children of `node` [Bp] in verify order (most likely draft first):
        (indices [Bp, K], valid [Bp, K])."""
        count = tree.tokens.shape[1]
        j = torch.arange(count, device=node.device)[None, :]
        child = (tree.parent == node[:, None]) & (j > 0) & (j != node[:, None])
        key = torch.where(child, j, j + count).sort(dim=1).values[:, :self.tree.topk]
        return key % count, key < count

    def accept_greedy(self, tree: Tree, arg: torch.Tensor, real: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(accepted drafts [Bp], the path's verify indices [Bp, S+1], the committed tokens
        [Bp, S+1]: the path's drafts, the bonus, zeros)."""
        bp, steps = arg.shape[0], self.tree.steps
        node = torch.zeros(bp, dtype=torch.int64, device=arg.device)
        going = real > 0
        accept = torch.zeros_like(node)
        path = [node]
        for _ in range(steps):
            child, valid = self._children(tree, node)
            want = arg.gather(1, node[:, None])
            match = valid & (tree.tokens.gather(1, child) == want)
            found = match.any(1) & going
            node = torch.where(found, child.gather(1, match.to(torch.int64).argmax(1)[:, None])
                               [:, 0], node)
            accept = accept + found.to(torch.int64)
            going = found
            path.append(node)
        bonus = arg.gather(1, node[:, None])[:, 0]
        return accept, torch.stack(path, 1), self._committed(tree, torch.stack(path, 1), accept,
                                                             bonus)

    def _committed(self, tree: Tree, path: torch.Tensor, accept: torch.Tensor,
                   bonus: torch.Tensor) -> torch.Tensor:
        """[Bp, S+1]: the tokens of path[1..a], the final token at column a, zeros after."""
        drafts = tree.tokens.gather(1, path[:, 1:])
        drafts = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], 1)
        col = torch.arange(drafts.shape[1], device=path.device)[None, :]
        return torch.where(col < accept[:, None], drafts,
                           torch.where(col == accept[:, None], bonus[:, None],
                                       torch.zeros_like(drafts)))

    def accept_sampled(self, tree: Tree, logits: torch.Tensor, real: torch.Tensor,
                       temp: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                       n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Multi-branch rejection sampling (greedy rows: the greedy rule); as
        `accept_greedy`."""
        bp, count, vocab = logits.shape
        steps, k = self.tree.steps, self.tree.topk
        p = probs(logits.reshape(bp * count, vocab),
                  temp[:, None].expand(bp, count).reshape(-1),
                  top_p[:, None].expand(bp, count).reshape(-1)).view(bp, count, vocab)
        u = uniforms(seed, n, SALT_ACCEPT, (steps + 1) * k).view(bp, steps + 1, k)
        arg = logits.argmax(-1)
        node = torch.zeros(bp, dtype=torch.int64, device=logits.device)
        going = real > 0
        accept = torch.zeros_like(node)
        residual = p[:, 0].clone()
        path = [node]
        for depth in range(steps + 1):
            residual = torch.where(going[:, None], p.gather(
                1, node[:, None, None].expand(bp, 1, vocab))[:, 0], residual)
            child, valid = self._children(tree, node)
            taken = torch.zeros_like(going)
            pick = node
            for i in range(k):
                token = tree.tokens.gather(1, child[:, i:i + 1])                    # [Bp, 1]
                trying = valid[:, i] & going & ~taken
                mass = residual.sum(-1)
                share = residual.gather(1, token)[:, 0] / mass.clamp(min=1e-30)
                ok = trying & (u[:, depth, i] < share)
                pick = torch.where(ok, child[:, i], pick)
                taken = taken | ok
                drop = trying & ~ok
                residual = torch.where(drop[:, None], residual.scatter(1, token, 0.0), residual)
            if depth == steps:
                taken = torch.zeros_like(taken)
            node = torch.where(taken, pick, node)
            accept = accept + taken.to(torch.int64)
            going = going & taken
            if depth < steps:
                path.append(node)
        # the final token: from the residual of the node where the walk stopped
        empty = residual.sum(-1, keepdim=True) <= 0
        at = p.gather(1, node[:, None, None].expand(bp, 1, vocab))[:, 0]
        final = sample_from(torch.where(empty, at, residual),
                            uniforms(seed, n, SALT_BONUS, 1)[:, 0])
        greedy = temp <= 0
        greedy_accept, greedy_path, greedy_tokens = self.accept_greedy(tree, arg, real)
        path_t = torch.stack(path, 1)
        tokens = self._committed(tree, path_t, accept, final)
        return (torch.where(greedy, greedy_accept, accept),
                torch.where(greedy[:, None], greedy_path, path_t),
                torch.where(greedy[:, None], greedy_tokens, tokens))
