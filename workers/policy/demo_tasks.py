"""The demo task domains: plain generators of ``{"prompt", "answer"}`` rows, split into disjoint
train and held-out pools. Torch-free, so the web process can offer them as example JSONL.

    ``addition``        two-digit addition, ``"37+48="`` -> ``"85"``
    ``multiplication``  two-digit times one-digit, ``"37*6="`` -> ``"222"``
    ``product``         two-digit times two-digit, ``"37*48="`` -> ``"1776"``: beyond the demo model alone; the
                        tool demo's domain (the model learns to compute it with a Python tool)
"""

from __future__ import annotations

import random
from typing import Literal

DOMAINS = ("addition", "multiplication")
TOOL_DOMAINS = ("product",)
Split = Literal["train", "heldout"]
HELDOUT_FRACTION = 0.2
# Pools are split by a fixed seed, independent of the caller's seed, so train and held-out never overlap.
_SPLIT_SEED = 1234


def _pool(domain: str) -> list[tuple[str, str]]:
    if domain == "addition":
        return [(f"{a}+{b}=", str(a + b)) for a in range(10, 100) for b in range(10, 100)]
    if domain == "multiplication":
        return [(f"{a}*{b}=", str(a * b)) for a in range(10, 100) for b in range(2, 10)]
    if domain == "product":
        return [(f"{a}*{b}=", str(a * b)) for a in range(10, 100) for b in range(10, 100)]
    raise ValueError(f"unknown demo domain {domain!r}; expected one of {', '.join((*DOMAINS, *TOOL_DOMAINS))}")


def _split_pool(domain: str, split: Split) -> list[tuple[str, str]]:
    pool = _pool(domain)
    random.Random(f"{_SPLIT_SEED}:{domain}").shuffle(pool)
    cut = int(len(pool) * HELDOUT_FRACTION)
    if split == "heldout":
        return pool[:cut]
    if split == "train":
        return pool[cut:]
    raise ValueError(f"unknown split {split!r}; expected 'train' or 'heldout'")


def demo_tasks(domain: str, n: int, seed: int = 0, split: Split = "train") -> list[dict[str, str]]:
    """``n`` rows ``{"prompt", "answer"}`` of a demo domain, drawn with replacement when n exceeds the pool.

    The held-out pool is disjoint from the train pool; the same (domain, n, seed, split) gives the same rows.
    """
    pool = _split_pool(domain, split)
    rng = random.Random(f"{seed}:{domain}:{split}")
    rows = rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]
    return [{"prompt": p, "answer": a} for p, a in rows]
