"""Device-side sampling and speculative acceptance: batched, fixed-shape, CUDA-graph capturable.

Every function here is a pure tensor function over a batch whose row `b` is one request. Rows may
mix greedy (temperature <= 0) and sampled requests; padded rows (zeros, `num_draft = 0`) give
finite, in-range outputs and never influence other rows. Nothing reads a value back to the host
(no `.item()`, `.tolist()`, `nonzero`, boolean-mask indexing, value-dependent shapes or Python
branches on tensor values), nothing uses a `torch.Generator`, and every shape is fixed by the
input shapes, so the same code runs eagerly on CPU, eagerly on CUDA, and inside a
`torch.cuda.CUDAGraph`. Shape errors are raised from shapes alone, naming the argument.

Randomness: counter-based, stateless (`uniforms`)
-------------------------------------------------
A uniform is a hash of (seed, counter, salt, index), so a draw never depends on what else is in
the batch, on the row index, on the device, or on any hidden state.
- `seed` [B] int64: the request's seed;
- `counter` [B] int64: unique per (request, round): the position `n` of the last committed token
  (it grows by `accept_len + 1 >= 1` every round, so no two rounds share a counter);
- `salt` (Python int): which draw of the round: `draft_salt(k)` for draft step k, `SALT_ACCEPT`
  for the accept tests, `SALT_RESIDUAL` / `SALT_BONUS` for the final token of a round,
  `SALT_SAMPLE` for plain (non-speculative) sampling;
- `index` 0..n-1: which of the `n` numbers of that draw (e.g. the draft position j).
The hash works on 32-bit words held in int64 tensors. The state starts at a fixed constant and
absorbs the words seed_lo, seed_hi, counter_lo, counter_hi (the row key, computed once per call and
shared by the draws of `verify`), then the salt, then the index, each as
`h = g((h XOR w) * K mod 2^32)` with `g(y) = y XOR (y >> 15)` and K odd (a bijection of w for a
fixed h). The final state goes through the MurmurHash3 finaliser `fmix32` (x ^= x>>16;
x *= 0x85ebca6b; x ^= x>>13; x *= 0xc2b2ae35; x ^= x>>16), a bijection with full avalanche, and
its top 24 bits give `u = k / 2^24` in [0, 1), exact in float32. A 32x32-bit product would
overflow int64, so `_mul32` computes `x * c_lo + (x mod 2^16) * c_hi * 2^16` (each term < 2^48)
and masks to 32 bits. Integer arithmetic is exact, so CPU and CUDA give bit-identical numbers.
The state is 32 bits: two different (seed, counter, salt, index) collide with probability 2^-32.
Cost matters here (each op is a kernel inside the graph): one uniforms call is ~60 torch
kernels, so on a GPU one Triton kernel (`kernels.uniforms`) does the same integer arithmetic.

Distributions (`probs`)
-----------------------
Temperature, then top-p (sort descending; keep the prefix of tokens whose preceding mass is below
top_p, at least the most likely one; renormalise), as the tests' host reference
(`tests/sampling_reference.py`, `target_probs`); the kept set is applied as a threshold on p (no
scatter back). Greedy rows are the one-hot of the argmax (first maximum on ties). The sort over the
vocabulary is the dominant cost of a round (see `scripts.bench.spec_decode`); `use_top_p=False`
skips it when no row needs it.

Sampling (`sample_from`)
------------------------
Inverse CDF: with `cdf = cumsum(w)` and `t = u * cdf[-1]` clamped strictly below `cdf[-1]`, the
token is the first i with `cdf[i] > t` (`searchsorted(..., right=True)`). A zero-weight token has
`cdf[i] == cdf[i-1]`, so it is never the first to exceed t; weights need not be normalised. It
runs in two levels (a search over chunk sums of CHUNK tokens, then inside the chosen chunk), since
a scan along a 100k-long row is slow on the GPU.

Speculative acceptance (`verify`), lossless w.r.t. p = probs(target_logits)
---------------------------------------------------------------------------
Draft token x_j (drawn from q_j) is kept when `u_j * q_j(x_j) < p_j(x_j)`, i.e. with probability
min(1, p_j(x)/q_j(x)); `accept_len` = number of leading kept tokens among the first `num_draft`
(a cumprod over "kept so far"). The final token at position a = accept_len is drawn from
normalise(max(p_a - q_a, 0)) (from p_a if that is all zero) when a draft was rejected there,
and from p_a (the bonus) when all `num_draft` drafts were kept. Then P(x kept) = min(p, q), and
P(final = y | rejected) * P(rejected) = max(p - q, 0)(y), which sum to p(y): the committed token
at every position is distributed as the target's. Greedy rows: kept iff x_j equals the target's
argmax, the final token is the target's argmax at position a (exact match, as
`accept_greedy` of `tests/sampling_reference.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workers import kernels

__all__ = [
    "SALT_ACCEPT", "SALT_RESIDUAL", "SALT_BONUS", "SALT_SAMPLE", "draft_salt",
    "uniforms", "probs", "sample_from", "sample_tokens", "draft_step", "verify", "verify_greedy",
    "Controls", "process_logits", "token_logprobs",
]

MASK32 = 0xFFFFFFFF
_IV = 0x243F6A88          # initial state (first digits of pi)
_K_ABSORB = 0x9E3779B1    # odd multiplier of the absorption step (golden-ratio prime)
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35

SALT_ACCEPT = 1
SALT_RESIDUAL = 2
SALT_BONUS = 3
SALT_SAMPLE = 4
_SALT_DRAFT = 0x10000     # draft step k uses _SALT_DRAFT + k
CHUNK = 256               # scans over the vocabulary run as [V / CHUNK, CHUNK]


def draft_salt(step: int) -> int:
    """The salt of draft step `step` (0 <= step < 2^16), distinct from every other salt."""
    if not 0 <= step < 0x10000:
        raise ValueError(f"step={step}: must be in [0, 65536)")
    return _SALT_DRAFT + step


# ---- counter-based uniforms ------------------------------------------------------------------

def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64 and a constant c < 2^32, overflow-free:
    x * c_lo + (x mod 2^16) * c_hi * 2^16, each term < 2^48 (4 kernels)."""
    return torch.add(x * (c & 0xFFFF), x & 0xFFFF, alpha=(c >> 16) << 16) & MASK32


def _fmix(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection of [0, 2^32) with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 13)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def _absorb(h: torch.Tensor, word: torch.Tensor | int) -> torch.Tensor:
    """One absorption step, g((h ^ word) * K mod 2^32) with g(y) = y ^ (y >> 15): a bijection of
    the word for a fixed state (h, word in [0, 2^32))."""
    y = _mul32(h ^ word, _K_ABSORB)
    return y ^ (y >> 15)


def _int64(name: str, t: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name}: must be an integer tensor, got {t.dtype}")
    if t.dim() != 1 or (batch is not None and t.shape[0] != batch):
        want = f"[{batch}]" if batch is not None else "[B]"
        raise ValueError(f"{name}: shape {list(t.shape)}, expected {want}")
    return t.to(torch.int64)


def _row_key(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """[B] the state after absorbing the 64-bit seed and counter (int64 [B] each; shared by a
    row's draws)."""
    h = _absorb(seed & MASK32, _IV)
    for word in ((seed >> 32) & MASK32, counter & MASK32, (counter >> 32) & MASK32):
        h = _absorb(h, word)
    return h


def _draw(key: torch.Tensor, salt: int, n: int) -> torch.Tensor:
    """[B, n] uniforms of draw `salt` from row keys [B] (n >= 1)."""
    index = torch.arange(n, dtype=torch.int64, device=key.device)
    h = _fmix(_absorb(_absorb(key, salt & MASK32)[:, None], index[None, :]))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def uniforms(seed: torch.Tensor, counter: torch.Tensor, salt: int, n: int) -> torch.Tensor:
    """[B, n] float32 uniforms in [0, 1), a stateless hash of (seed[b], counter[b], salt, index).

    Same inputs give the same numbers on every device and whatever else is in the batch (on a
    GPU one fused kernel does the same integer arithmetic: `kernels.uniforms`).
    """
    seed = _int64("seed", seed)
    counter = _int64("counter", counter, seed.shape[0])
    if n < 1:
        raise ValueError(f"n={n}: must be >= 1")
    if kernels.enabled(seed):
        return kernels.uniforms(seed, counter, salt & MASK32, n)
    return _draw(_row_key(seed, counter), salt, n)


# ---- distributions and inverse-CDF sampling --------------------------------------------------

def _rows(name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    if t.shape != (n,):
        raise ValueError(f"{name}: shape {list(t.shape)}, expected [{n}] (one value per row)")
    return t


def probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, *,
          use_top_p: bool = True, top_k: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] float32 distributions: temperature, then top-k, then top-p; one-hot argmax where
    temperature <= 0.

    Row by row equal (to float tolerance) to the host reference `target_probs` of
    `tests/sampling_reference.py`; where tokens tie at a cut all of them are kept (the reference
    keeps an arbitrary subset at the top-p cut). A top_p <= 0 keeps only the most likely token (so
    padded rows stay finite). `use_top_p=False` (a static, host-known promise that every row has
    top_p >= 1 and no top-k) skips the sort over the vocabulary.

    `top_k` [N] int (None: no row has one): a row with k >= 1 keeps its k most likely tokens
    (and any tied with the k-th), renormalised, and then top-p applies to that distribution (as
    vLLM composes them); k <= 0 is off, and such a row's result is bit-identical to `top_k=None`.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits: shape {list(logits.shape)}, expected [N, V]")
    n, vocab = logits.shape
    temperature = _rows("temperature", temperature, n).float()
    top_p = _rows("top_p", top_p, n).float()
    logits = logits.float()
    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    p = torch.softmax(logits / safe_t[:, None], dim=-1)
    rank = torch.arange(vocab, device=logits.device)
    one_hot = (rank[None, :] == logits.argmax(-1, keepdim=True)).float()
    if not use_top_p and top_k is None:
        return torch.where(greedy[:, None], one_hot, p)
    sorted_p = p.sort(dim=-1, descending=True)[0]
    if top_k is None:
        mass_before = _cumsum(sorted_p) - sorted_p
        n_keep = ((mass_before < top_p[:, None]) | (rank == 0)[None, :]).sum(-1, keepdim=True)
        restricted = top_p < 1
    else:
        k = _rows("top_k", top_k, n).to(torch.int64)
        on = k > 0
        # the k-th largest probability (the smallest one for rows without top-k): the top-k set
        # is every token at or above it, a prefix of the sorted row (ties at the cut included)
        kth = sorted_p.gather(1, (torch.where(on, k.clamp_max(vocab), vocab) - 1)[:, None])
        in_top_k = sorted_p >= kth
        top_sorted = torch.where(in_top_k, sorted_p, torch.zeros_like(sorted_p))
        mass_before = _cumsum(top_sorted) - top_sorted
        # top-p of the renormalised top-k distribution: preceding mass below top_p * its total
        limit = torch.where(on, top_p * top_sorted.sum(-1), top_p)
        n_top_p = ((mass_before < limit[:, None]) | (rank == 0)[None, :]).sum(-1, keepdim=True)
        n_top_p = torch.where((top_p < 1)[:, None], n_top_p, torch.full_like(n_top_p, vocab))
        n_keep = torch.minimum(n_top_p, in_top_k.sum(-1, keepdim=True))
        restricted = (top_p < 1) | on
    cut = sorted_p.gather(1, n_keep - 1)              # the smallest kept probability
    kept = torch.where(p >= cut, p, torch.zeros_like(p))
    nucleus = kept / kept.sum(-1, keepdim=True)
    # rows with top_p >= 1 and no top-k keep the plain softmax (as the reference; no
    # float-cumsum tail cut)
    p = torch.where(restricted[:, None], nucleus, p)
    return torch.where(greedy[:, None], one_hot, p)


def _chunks(x: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N, K, C] (C = min(V, CHUNK), zero-padded to K * C): long scans as short ones."""
    n, vocab = x.shape
    c = min(vocab, CHUNK)
    k = -(-vocab // c)
    if k * c != vocab:
        x = torch.nn.functional.pad(x, (0, k * c - vocab))
    return x.reshape(n, k, c)


def _cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumsum of [N, V] rows, computed chunk-wise (a scan over 100k-long rows is slow)."""
    n, vocab = x.shape
    inner = _chunks(x).cumsum(-1)                                    # [N, K, C]
    totals = inner[:, :, -1]
    offsets = totals.cumsum(-1) - totals                             # exclusive, [N, K]
    return (inner + offsets[:, :, None]).reshape(n, -1)[:, :vocab]


def sample_from(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N] int64: token i of row r with probability weights[r, i] / sum(weights[r]), via `u` [N].

    Inverse CDF in two levels (chunks of CHUNK tokens, then tokens inside the chosen chunk);
    `weights` must be non-negative (need not sum to one). Zero-weight tokens are never chosen;
    an all-zero row returns V - 1.
    """
    if weights.dim() != 2:
        raise ValueError(f"weights: shape {list(weights.shape)}, expected [N, V]")
    n, vocab = weights.shape
    u = _rows("u", u, n)
    chunks = _chunks(weights.float())                                # [N, K, C]
    k, c = chunks.shape[1:]
    chunk_cdf = chunks.sum(-1).cumsum(-1)                            # [N, K]
    t = _below(u[:, None].float() * chunk_cdf[:, -1:], chunk_cdf[:, -1:])
    chunk = torch.searchsorted(chunk_cdf, t, right=True).clamp_max(k - 1)          # [N, 1]
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp_min(0)),
                         torch.zeros_like(t))
    inside = chunks.gather(1, chunk[:, :, None].expand(n, 1, c))[:, 0].cumsum(-1)  # [N, C]
    t = _below(t - before, inside[:, -1:])
    token = torch.searchsorted(inside, t, right=True).clamp_max(c - 1)
    return (chunk * c + token)[:, 0].clamp_max(vocab - 1)


def _below(t: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """t clamped to [0, largest float below total] (to total itself when total is 0)."""
    return torch.minimum(t, torch.nextafter(total, torch.zeros_like(total))).clamp_min(0.0)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  seed: torch.Tensor, counter: torch.Tensor, salt: int = SALT_SAMPLE, *,
                  use_top_p: bool = True, all_greedy: bool = False,
                  top_k: torch.Tensor | None = None) -> torch.Tensor:
    """[N] int64: one token per row from probs(logits, ..., top_k) (the argmax on greedy rows).

    `all_greedy=True` (static: every row has temperature 0) returns the argmax alone.
    """
    if all_greedy:
        return logits.argmax(-1)
    p = probs(logits, temperature, top_p, use_top_p=use_top_p, top_k=top_k)
    u = uniforms(seed, counter, salt, 1)[:, 0]
    greedy = temperature <= 0
    return torch.where(greedy, logits.argmax(-1), sample_from(p, u))


def draft_step(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
               seed: torch.Tensor, counter: torch.Tensor, step: int, *,
               use_top_p: bool = True,
               all_greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft step `step` of a round: (tokens [B] int64, q [B, V] float32).

    q = probs(logits, temperature, top_p) (one-hot on greedy rows, whose token is the argmax);
    sampled rows draw from q with the uniform of salt `draft_salt(step)`. Pass `q` on to `verify`.
    Any q is lossless as long as the drafts are drawn from it, so a caller may draft without top-p
    (`use_top_p=False`: no sort) even when the target uses it. `all_greedy=True` (static: every
    row greedy) is the argmax and its one-hot, nothing else.
    """
    if all_greedy:
        tokens = logits.argmax(-1)
        if kernels.enabled(logits):
            return tokens, kernels.one_hot(tokens, logits.shape[-1])
        rank = torch.arange(logits.shape[-1], device=logits.device)
        return tokens, (rank[None, :] == tokens[:, None]).float()
    q = probs(logits, temperature, top_p, use_top_p=use_top_p)
    u = uniforms(seed, counter, draft_salt(step), 1)[:, 0]
    greedy = temperature <= 0
    return torch.where(greedy, logits.argmax(-1), sample_from(q, u)), q


# ---- logits processing: min_tokens, penalties; logprobs ---------------------------------------

@dataclass(frozen=True)
class Controls:
    """Per-row inputs of the logits processing of a round (`process_logits`) and its top-k; one
    row per request, gathered from the slot state. Neutral values (top_k 0, stop_until 0,
    presence 0, frequency 0, repetition 1) leave a row's logits bit-identical."""

    top_k: torch.Tensor        # [B] int64: k >= 1, or 0 (off)
    stop_ids: torch.Tensor     # [B, M] int64: the ids min_tokens masks (padded with repeats)
    stop_until: torch.Tensor   # [B] int64: a token at an absolute position below it is no stop
    presence: torch.Tensor     # [B] float32
    frequency: torch.Tensor    # [B] float32
    repetition: torch.Tensor   # [B] float32 (1: off)
    counts: torch.Tensor       # [B, V] int32: each token's count among the generated tokens
    seen: torch.Tensor         # [B, V] bool: the token occurs in the prompt

    @staticmethod
    def neutral(b: int, vocab: int, device: torch.device | str = "cpu") -> "Controls":
        """Controls that change nothing (for `b` rows over `vocab` tokens)."""
        def zeros(*shape: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=device)
        return Controls(top_k=zeros(b), stop_ids=zeros(b, 1), stop_until=zeros(b),
                        presence=zeros(b, dt=torch.float32), frequency=zeros(b, dt=torch.float32),
                        repetition=torch.ones(b, dtype=torch.float32, device=device),
                        counts=zeros(b, vocab, dt=torch.int32),
                        seen=zeros(b, vocab, dt=torch.bool))


def _penalised(logits: torch.Tensor, count: torch.Tensor, seen: torch.Tensor,
               presence: torch.Tensor, frequency: torch.Tensor,
               repetition: torch.Tensor) -> torch.Tensor:
    """Penalties on logits, element-wise (broadcasting): the repetition penalty on tokens of the
    prompt or generated so far (logits > 0 divided by it, others multiplied), then
    `- frequency * count - presence * [count > 0]` (OpenAI's, over the generated tokens)."""
    generated = count > 0
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen | generated, scaled, logits)
    return logits - frequency * count - presence * generated.to(logits.dtype)


def process_logits(logits: torch.Tensor, counter: torch.Tensor, controls: Controls,
                   draft: torch.Tensor | None = None) -> torch.Tensor:
    """[B, W, V] float32: the target's logits over a verify window (or W = 1: plain decoding)
    after min_tokens and the penalties, position by position.

    Window position j of row b draws the token at absolute position `counter[b] + j + 1`
    (`counter` = n, the position of the last committed token; at a prefill, the last prompt
    position). min_tokens: where that position is below `stop_until`, the stop ids' logits are
    -inf. Penalties: position j conditions on the committed tokens (`controls.counts`) and on
    the drafts d_1 .. d_j before it (`draft` [B, W-1], their ids as drawn), so the counts at
    position j add those drafts: the whole window is penalised with the committed counts, then
    each draft token's logit is recomputed at every position with its count in that position's
    prefix (writes for the same token at the same position carry the same value). Rows with
    neutral controls come back bit-identical. Pure tensor code, capturable.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits: shape {list(logits.shape)}, expected [B, W, V]")
    b, w, vocab = logits.shape
    dev = logits.device
    logits = logits.float()
    # min_tokens: the stop ids may not be drawn below stop_until
    pos = counter.to(torch.int64)[:, None] + 1 + torch.arange(w, device=dev)[None, :]   # [B, W]
    early = pos < controls.stop_until[:, None]
    ids = controls.stop_ids[:, None, :].expand(b, w, controls.stop_ids.shape[1])
    current = logits.gather(2, ids)
    logits = logits.scatter(2, ids, torch.where(early[..., None],
                                                torch.full_like(current, float("-inf")),
                                                current))
    presence = controls.presence.float()[:, None, None]
    frequency = controls.frequency.float()[:, None, None]
    repetition = controls.repetition.float()[:, None, None]
    out = _penalised(logits, controls.counts[:, None, :].float(), controls.seen[:, None, :],
                     presence, frequency, repetition)
    if draft is None or draft.shape[1] == 0:
        return out
    s = draft.shape[1]
    if s != w - 1:
        raise ValueError(f"draft: shape {list(draft.shape)}, expected [{b}, {w - 1}]")
    d = draft.to(torch.int64).clamp(0, vocab - 1)                                # [B, S]
    same = (d[:, :, None] == d[:, None, :]).to(torch.int64)                      # [B, S, S]
    # before[b, i, j]: how many of the drafts d_0 .. d_{j-1} equal draft d_i
    before = torch.cat([torch.zeros_like(same[:, :, :1]), same.cumsum(-1)], -1)  # [B, S, W]
    before = before.transpose(1, 2)                                              # [B, W, S]
    idx = d[:, None, :].expand(b, w, s)
    count = controls.counts.gather(1, d)[:, None, :].to(torch.int64) + before
    seen = controls.seen.gather(1, d)[:, None, :].expand(b, w, s)
    value = _penalised(logits.gather(2, idx), count.float(), seen, presence, frequency,
                       repetition)
    return out.scatter(2, idx, value)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw log-probabilities (log_softmax of `logits` [N, V], float32): of `tokens` [N] and
    of each row's `k` most likely tokens -> (token_lp [N], top_lp [N, k], top_ids [N, k] int64),
    top-k in descending order."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    token_lp = lp.gather(1, tokens.to(torch.int64).clamp(0, lp.shape[1] - 1)[:, None])[:, 0]
    top_lp, top_ids = lp.topk(k, dim=-1)
    return token_lp, top_lp, top_ids


# ---- verify and accept -----------------------------------------------------------------------

def _check_verify(draft: torch.Tensor, q: torch.Tensor, target_logits: torch.Tensor,
                  per_row: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    if draft.dim() != 2:
        raise ValueError(f"draft: shape {list(draft.shape)}, expected [B, S]")
    b, s = draft.shape
    if target_logits.dim() != 3 or target_logits.shape[:2] != (b, s + 1):
        raise ValueError(f"target_logits: shape {list(target_logits.shape)}, expected "
                         f"[{b}, {s + 1}, V] (draft is [{b}, {s}])")
    vocab = target_logits.shape[2]
    if q.shape != (b, s, vocab):
        raise ValueError(f"q: shape {list(q.shape)}, expected [{b}, {s}, {vocab}]")
    for name, t in per_row.items():
        if t.shape != (b,):
            raise ValueError(f"{name}: shape {list(t.shape)}, expected [{b}]")
    if draft.dtype.is_floating_point:
        raise TypeError(f"draft: must be an integer tensor, got {draft.dtype}")
    return b, s, vocab


def verify(draft: torch.Tensor, q: torch.Tensor, target_logits: torch.Tensor,
           temperature: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
           counter: torch.Tensor, num_draft: torch.Tensor, fill: int = 0, *,
           use_top_p: bool = True, all_greedy: bool = False,
           top_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a round's drafts against the target: (accept_len [B] int64, tokens [B, S+1] int64).

    `draft` [B, S] was drawn from `q` [B, S, V]; `target_logits` [B, S+1, V] are the target's
    logits over [x_n, d_1..d_S]; only the first `num_draft[b]` (clamped to [0, S]) drafts of a
    row count. `tokens[b, :accept_len[b] + 1]` are the committed tokens (accepted drafts, then the
    replacement or bonus); the rest hold `fill`. Draft ids outside [0, V) are never accepted.
    Static, host-known shortcuts (each a separate CUDA graph if used): `use_top_p=False` when no
    row has top_p < 1 (no sort); `all_greedy=True` when every row is greedy (argmax only; q,
    top_p, seed and counter are then not read). `top_k` [B] (None: no row has one): the target's
    distribution is `probs(..., top_k)`, so acceptance, residual and bonus keep its top-k.
    Logits processing that depends on the window position (min_tokens, penalties) is applied to
    `target_logits` beforehand (`process_logits`).
    """
    b, s, vocab = _check_verify(draft, q, target_logits, {
        "temperature": temperature, "top_p": top_p, "seed": seed, "counter": counter,
        "num_draft": num_draft})
    dev = target_logits.device
    target_arg = target_logits.argmax(-1)                                  # [B, S+1]
    if all_greedy:
        return verify_greedy(draft, target_arg, num_draft, vocab, fill)
    draft = draft.to(torch.int64)
    in_range = (draft >= 0) & (draft < vocab)
    x = draft.clamp(0, vocab - 1)
    steps = torch.arange(s, device=dev)
    n_draft = num_draft.to(torch.int64).clamp(0, s)                        # [B]
    counted = steps[None, :] < n_draft[:, None]
    pos = torch.arange(s + 1, device=dev)[None, :]
    padded_draft = torch.cat([x, torch.full_like(x[:, :1], fill)], dim=1)  # [B, S+1]

    greedy = temperature <= 0                                               # [B]
    p = probs(target_logits.reshape(b * (s + 1), vocab),
              temperature[:, None].expand(b, s + 1).reshape(-1),
              top_p[:, None].expand(b, s + 1).reshape(-1),
              use_top_p=use_top_p,
              top_k=None if top_k is None else top_k[:, None].expand(b, s + 1).reshape(-1)
              ).view(b, s + 1, vocab)

    # Which drafts are kept (vectorised over batch and steps), then the leading run of them.
    px = p[:, :s].gather(2, x[..., None])[..., 0]                           # [B, S]
    qx = q.float().gather(2, x[..., None])[..., 0]
    kept_sampled = uniforms(seed, counter, SALT_ACCEPT, max(s, 1))[:, :s] * qx < px
    kept_greedy = x == target_arg[:, :s]
    kept = torch.where(greedy[:, None], kept_greedy, kept_sampled) & in_range & counted
    accept_len = kept.to(torch.int64).cumprod(1).sum(1)                     # [B]

    # The final token at position a: residual after a rejection, else the bonus from p_a.
    rejected = accept_len < n_draft                                         # [B]
    p_a = p.gather(1, accept_len[:, None, None].expand(b, 1, vocab))[:, 0]  # [B, V]
    if s > 0:
        q_a = q.float().gather(1, accept_len.clamp_max(s - 1)[:, None, None]
                               .expand(b, 1, vocab))[:, 0]
    else:
        q_a = torch.zeros_like(p_a)
    residual = (p_a - q_a).clamp_min(0.0)
    use_residual = rejected[:, None] & (residual.sum(-1, keepdim=True) > 0)
    weights = torch.where(use_residual, residual, p_a)
    u_final = torch.where(rejected, uniforms(seed, counter, SALT_RESIDUAL, 1)[:, 0],
                          uniforms(seed, counter, SALT_BONUS, 1)[:, 0])
    final = torch.where(greedy, target_arg.gather(1, accept_len[:, None])[:, 0],
                        sample_from(weights, u_final))
    return accept_len, _commit(padded_draft, accept_len, final, pos, fill)


def verify_greedy(draft: torch.Tensor, target_arg: torch.Tensor, num_draft: torch.Tensor,
                  vocab: int, fill: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify`` of an all-greedy batch from the target's argmax ``target_arg`` [B, S+1] (what
    it computes from the logits): draft j of row b is kept when it is in ``[0, vocab)``, equals
    ``target_arg[b, j]`` and ``j < clamp(num_draft[b], 0, S)``; the final token is
    ``target_arg[b, accept_len]``. One launch on a GPU (``kernels.greedy_accept``)."""
    b, s = draft.shape
    if target_arg.shape != (b, s + 1):
        raise ValueError(f"target_arg: shape {list(target_arg.shape)}, expected [{b}, {s + 1}]")
    if s > 0 and kernels.enabled(target_arg):
        return kernels.greedy_accept(draft, target_arg, num_draft, vocab, fill)
    dev = target_arg.device
    draft = draft.to(torch.int64)
    in_range = (draft >= 0) & (draft < vocab)
    x = draft.clamp(0, vocab - 1)
    n_draft = num_draft.to(torch.int64).clamp(0, s)
    counted = torch.arange(s, device=dev)[None, :] < n_draft[:, None]
    pos = torch.arange(s + 1, device=dev)[None, :]
    padded_draft = torch.cat([x, torch.full_like(x[:, :1], fill)], dim=1)  # [B, S+1]
    kept = (x == target_arg[:, :s]) & in_range & counted
    accept_len = kept.to(torch.int64).cumprod(1).sum(1)
    final = target_arg.gather(1, accept_len[:, None])[:, 0]
    return accept_len, _commit(padded_draft, accept_len, final, pos, fill)


def _commit(padded_draft: torch.Tensor, accept_len: torch.Tensor, final: torch.Tensor,
            pos: torch.Tensor, fill: int) -> torch.Tensor:
    """[B, S+1]: the accepted drafts, the final token at accept_len, `fill` after it."""
    return torch.where(pos < accept_len[:, None], padded_draft,
                       torch.where(pos == accept_len[:, None], final[:, None],
                                   torch.full_like(padded_draft, fill)))
