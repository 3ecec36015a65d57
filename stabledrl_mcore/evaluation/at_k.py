"""Metrics over K samples per prompt: pass@k, maj@k and mean@k (``stabledrl eval --n K``).

For one example with ``n`` samples of which ``c`` are correct (``task.is_correct``):

* ``pass@k`` is the unbiased estimator of Chen et al. (2021),
  ``1 - C(n - c, k) / C(n, k)``: the chance that at least one of k samples drawn
  without replacement from the n is correct (1 when ``n - c < k``).
* ``maj@k``: majority vote over the extracted answers of the *first* k samples;
  answers are grouped by ``task.same_answer`` (the task's own equivalence, e.g.
  numeric or math-verify), a sample without an extracted answer does not vote,
  and the example counts as correct when the winning group's first sample is
  correct. Ties: the group whose first member comes first (the earliest sample)
  wins. No vote at all: incorrect.
* ``mean@k``: the mean task reward of the first k samples.

A run's figure is the mean over examples. Default ``ks``: the powers of two up to n.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one example with ``c`` correct out of ``n`` samples."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_vote(
    answers: Sequence[Optional[str]], same: Callable[[str, str], bool] = lambda a, b: a == b
) -> Tuple[Optional[int], int]:
    """``(index of the winning group's first sample, its votes)``; ``(None, 0)`` when nobody voted.

    ``None`` answers do not vote; ties go to the group whose first member is earliest."""
    groups: List[List[int]] = []
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        for group in groups:
            if same(answers[group[0]], answer):
                group.append(i)
                break
        else:
            groups.append([i])
    if not groups:
        return None, 0
    best = max(groups, key=len)  # the first of the largest: groups are ordered by their first member
    return best[0], len(best)


def default_ks(n: int) -> List[int]:
    """1, 2, 4, ... up to ``n``."""
    return [1 << i for i in range(n.bit_length()) if 1 << i <= n]


def check_ks(ks: Sequence[int], n: int, flag: str = "--k") -> List[int]:
    """``ks`` sorted and unique, each in 1..n; a ``ValueError`` naming ``flag`` otherwise."""
    bad = [k for k in ks if not 1 <= int(k) <= n]
    if bad or not ks:
        raise ValueError(
            f"{flag} {','.join(map(str, ks)) or '(empty)'}: every k must be in 1..{n} (the samples per prompt, --n {n})"
        )
    return sorted({int(k) for k in ks})


def sample_metrics(
    samples: Sequence[Dict[str, Any]], ks: Sequence[int], same: Callable[[str, str], bool]
) -> Dict[str, Any]:
    """pass@k, maj@k, mean@k of one example's samples (dicts with ``extracted``, ``reward``,
    ``correct``), and the majority answer of all of them with its votes."""
    n = len(samples)
    c = sum(bool(s["correct"]) for s in samples)
    answers = [None if s["extracted"] is None else str(s["extracted"]) for s in samples]
    out: Dict[str, Any] = {"num_correct": c}
    for k in ks:
        out[f"pass@{k}"] = pass_at_k(n, c, k)
    for k in ks:
        winner, _ = majority_vote(answers[:k], same)
        out[f"maj@{k}"] = float(winner is not None and bool(samples[winner]["correct"]))
    for k in ks:
        out[f"mean@{k}"] = sum(float(s["reward"]) for s in samples[:k]) / k
    winner, votes = majority_vote(answers, same)
    out["majority"] = {"answer": None if winner is None else answers[winner], "votes": votes}
    return out


def summarize(per_example: Sequence[Dict[str, Any]], ks: Sequence[int]) -> Dict[str, float]:
    """The mean over examples of every ``pass@k`` / ``maj@k`` / ``mean@k`` (0.0 for none)."""
    names = [f"{metric}@{k}" for metric in ("pass", "maj", "mean") for k in ks]
    count = max(len(per_example), 1)
    return {name: sum(m[name] for m in per_example) / count for name in names}
