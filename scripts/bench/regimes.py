"""Prompt regimes the benchmarks share: code (middling acceptance), high-entropy random base64
(near-zero acceptance) and repetitive runs (saturated acceptance) for the bundled byte pair."""
from __future__ import annotations

import random

KINDS = ("code", "high_entropy", "repetitive")
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def code_prompts(n: int, rng: random.Random) -> list[str]:
    """Python function openings: a signature, a docstring, the start of a body."""
    verbs = ["parse", "merge", "load", "render", "split", "count", "normalize", "validate"]
    nouns = ["config", "records", "intervals", "header", "tokens", "path", "matrix", "options"]
    bodies = ["result = []\n    for item in {n}:\n        ", "if not {n}:\n        return None\n    ",
              "with open({n}) as f:\n        ", "total = 0\n    for key, value in {n}.items():\n"]
    out = []
    for i in range(n):
        verb, noun = verbs[i % len(verbs)], nouns[(i * 3) % len(nouns)]
        body = bodies[i % len(bodies)].format(n=noun)
        out.append(f'def {verb}_{noun}({noun}, strict=False):\n    """{verb.capitalize()} the '
                   f'{noun} and return the result."""\n    {body}')
    rng.shuffle(out)
    return out


def high_entropy_prompts(n: int, rng: random.Random) -> list[str]:
    """Random base64: a bare blob, or an opened `TOKEN = "...` string (as code embeds keys)."""
    return ["".join(rng.choice(B64) for _ in range(160)) if i % 2 == 0 else
            '    TOKEN = "' + "".join(rng.choice(B64) for _ in range(48)) for i in range(n)]


def repetitive_prompts(n: int, rng: random.Random) -> list[str]:
    """Runs of one character and ruler lines, as code's separators and padding are (the bundled
    pair continues these and its head predicts them: the saturated regime, see its model card)."""
    chars = "#*= -0_~"
    out = []
    for i in range(n):
        c = chars[i % len(chars)]
        out.append(c * rng.randint(80, 140) if i % 3 else ("#" + c * 70 + "\n") * 2)
    rng.shuffle(out)
    return out


def make_prompts(n: int, seed: int = 0) -> dict[str, list[str]]:
    """`n` prompts of every regime."""
    rng = random.Random(seed)
    return {"code": code_prompts(n, rng), "high_entropy": high_entropy_prompts(n, rng),
            "repetitive": repetitive_prompts(n, rng)}
