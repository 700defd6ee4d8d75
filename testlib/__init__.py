"""testlib: helpers for the tests of every package (bottom layer, test-only; see build_defs/layers.bzl)."""
