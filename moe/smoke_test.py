import sys

import jax
import pytest


def test_jax_runs():
    assert int(jax.numpy.arange(4).sum()) == 6


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
