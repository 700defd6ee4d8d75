"""Tests for evaluation.passk against hand-computed values, the exact binomial form and edges.

Tolerance policy: the product form and the exact rational C(n-c,k)/C(n,k) agree to float64
rounding; comparisons use rel 1e-12 (observed gaps ~1e-16), far below any formula error.
"""

import math
import sys
from fractions import Fraction

import pytest

from evaluation import passk


def _exact(n, c, k):
  return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def test_hand_computed_values():
  assert passk.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10, rel=1e-12)  # 1 - C(3,2)/C(5,2)
  assert passk.pass_at_k(10, 1, 1) == pytest.approx(0.1, rel=1e-12)  # pass@1 = c/n
  assert passk.pass_at_k(4, 1, 2) == pytest.approx(0.5, rel=1e-12)  # 1 - C(3,2)/C(4,2) = 1-3/6
  assert passk.pass_at_k(6, 3, 3) == pytest.approx(1 - 1 / 20, rel=1e-12)  # 1 - C(3,3)/C(6,3)


def test_matches_exact_binomial_form_without_overflow():
  for n, c, k in [(20, 3, 5), (50, 10, 1), (100, 1, 10), (200, 37, 100), (1000, 5, 500)]:
    assert passk.pass_at_k(n, c, k) == pytest.approx(_exact(n, c, k), rel=1e-12)
  # pass@1 is c/n for every n, c.
  for n in (1, 7, 64):
    for c in range(n + 1):
      assert passk.pass_at_k(n, c, 1) == pytest.approx(c / n, rel=1e-12, abs=1e-15)


def test_edges():
  assert passk.pass_at_k(10, 0, 5) == 0.0  # c = 0
  assert passk.pass_at_k(10, 10, 5) == 1.0  # c = n
  assert passk.pass_at_k(10, 6, 5) == 1.0  # n - c < k: every draw holds a pass
  assert passk.pass_at_k(1, 1, 1) == 1.0 and passk.pass_at_k(1, 0, 1) == 0.0
  with pytest.raises(ValueError, match="k must lie"):
    passk.pass_at_k(3, 1, 4)  # k > n
  with pytest.raises(ValueError, match="k must lie"):
    passk.pass_at_k(3, 1, 0)
  with pytest.raises(ValueError, match="c must lie"):
    passk.pass_at_k(3, 4, 1)
  with pytest.raises(ValueError, match="at least one"):
    passk.pass_at_k(0, 0, 1)
  with pytest.raises(ValueError, match="integer"):
    passk.pass_at_k(3.5, 1, 1)


def test_mean_is_unbiased_not_the_naive_formula():
  counts = [(4, 1), (4, 0), (4, 4)]
  assert passk.mean_pass_at_k(counts, 2) == pytest.approx((0.5 + 0 + 1) / 3, rel=1e-12)
  naive = (1 - (1 - 1 / 4) ** 2 + 0 + 1) / 3
  assert passk.mean_pass_at_k(counts, 2) != pytest.approx(naive)
  with pytest.raises(ValueError):
    passk.mean_pass_at_k([], 1)


def test_check_k_list():
  assert passk.check_k_list([5, 1, 1], 5) == (1, 5)
  with pytest.raises(ValueError, match=r"\[6\]"):
    passk.check_k_list([1, 6], 5)
  with pytest.raises(ValueError):
    passk.check_k_list([], 5)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
