"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code", eq. 1).

With n samples of a task of which c pass, the probability that at least one of k samples drawn
without replacement passes is

    pass@k = 1 - C(n - c, k) / C(n, k).

The binomial coefficients overflow floats for moderate n (C(200, 100) ~ 9e58), so the ratio is
computed as the product prod_{i = n-c+1}^{n} (1 - k / i), every factor in [0, 1), which is exact
algebra (the paper's numpy form) and never overflows. When n - c < k every draw of k contains a
passing sample and pass@k is exactly 1.

pass@k over a suite is the mean of the per-task values; it is an unbiased estimate of the
expected pass@k, unlike 1 - (1 - c/n)^k, which is biased low.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def _check_int(name: str, v) -> int:
  if isinstance(v, bool) or not hasattr(v, "__index__"):  # ints and numpy integers
    raise ValueError(f"{name} must be an integer, got {v!r}")
  return int(v)


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one task with `c` of `n` samples passing.

  Raises:
    ValueError: n < 1, c outside [0, n], or k outside [1, n] (k > n cannot be estimated from
      n samples).
  """
  n, c, k = _check_int("n", n), _check_int("c", c), _check_int("k", k)
  if n < 1:
    raise ValueError(f"need at least one sample, got n={n}")
  if not 0 <= c <= n:
    raise ValueError(f"c must lie in [0, n={n}], got c={c}")
  if not 1 <= k <= n:
    raise ValueError(f"k must lie in [1, n={n}], got k={k} (pass@k needs n >= k samples)")
  if n - c < k:
    return 1.0
  prod = 1.0
  for i in range(n - c + 1, n + 1):
    prod *= 1.0 - k / i
  return 1.0 - prod


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
  """Mean pass@k over tasks given as (n, c) pairs (every task needs n >= k)."""
  vals = [pass_at_k(n, c, k) for n, c in counts]
  if not vals:
    raise ValueError("no tasks")
  return sum(vals) / len(vals)


def check_k_list(k_list: Sequence[int], n: int) -> tuple[int, ...]:
  """Validates the k values for n samples per task: sorted, unique, each in [1, n]."""
  ks = tuple(sorted({_check_int("k", k) for k in k_list}))
  if not ks:
    raise ValueError("k_list is empty")
  bad = [k for k in ks if not 1 <= k <= n]
  if bad:
    raise ValueError(f"k values {bad} are outside [1, n={n}]: pass@k needs at least k samples "
                     "per task; raise n or drop those k")
  return ks
