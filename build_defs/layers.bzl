"""The layers of the monorepo: which top-level package may depend on which, enforced by Bazel.

    tools/  entry points, gin, benchmarks            tests/  cross-package tests
       |                                                 (may use every layer but tools)
    experiment/  the main job                        launch/  launcher (uses nothing of ours)
       |
    pipeline/  asynchronous RL     evaluation/  pass@k
       |                              |
    rl/  learner     rollout/  sampler  -->  sync/  weight sync     envs/  sandboxes, harness, tasks
       |                |                      |                       |
    moe/  the model (the bottom: uses nothing of ours)
    testlib/  test-only helpers (usable by the test code of every layer)

An arrow or a line down means "may depend on". Packages on one row do not depend on each other
except as drawn (rollout applies sync's deltas); envs stands beside rl, rollout and sync, and
only pipeline, evaluation and what is above them use it.

build_defs/ and third_party/ (Bazel infrastructure: macros, the venv toolchain, offline rule
stand-ins) are outside the layers and visible to all.

`LAYERS[p]` lists the packages `p` may depend on (import, and name in its BUILD deps). Each
package's BUILD sets `package(default_visibility = visible_to("p"))`, so a target of `p` is
visible only to `p`'s own subpackages and to the packages whose LAYERS entry names `p`: a
wrong-way dependency (e.g. moe on pipeline) fails `bazel build` with "is not visible".
build_defs/layering_test.py checks the same table against every Python import (Bazel sees only
declared deps) and proves, with a nested Bazel, that a wrong-way dependency is rejected.

This file is Starlark and, being a plain dict literal, is also read by that test with Python's
`ast.literal_eval`: keep LAYERS a literal.
"""

LAYERS = {
    "testlib": [],
    "moe": [],
    "envs": ["moe"],
    "rl": ["moe"],
    "sync": ["moe"],
    "rollout": ["moe", "sync"],
    "pipeline": ["moe", "envs", "rl", "rollout", "sync"],
    "evaluation": ["moe", "envs", "rl", "rollout", "sync"],
    "experiment": ["moe", "envs", "rl", "rollout", "sync", "pipeline", "evaluation"],
    "launch": [],
    "tools": ["moe", "envs", "rl", "rollout", "sync", "pipeline", "evaluation", "experiment", "launch"],
    "tests": ["moe", "envs", "rl", "rollout", "sync", "pipeline", "evaluation", "experiment", "launch"],
}

# Test code (files named *_test.py or testing.py) may also use these, whatever its layer.
TEST_ONLY = ["testlib"]

def _users(pkg):
    """The packages allowed to depend on `pkg`."""
    out = [p for p, deps in LAYERS.items() if pkg in deps]
    if pkg in TEST_ONLY:
        out = [p for p in LAYERS if p != pkg]
    return out

def layer_package_groups():
    """One package_group per layer, `may_use_<pkg>`: the package itself and those above it."""
    for pkg in LAYERS:
        native.package_group(
            name = "may_use_" + pkg,
            packages = ["//%s/..." % p for p in [pkg] + _users(pkg)],
        )

def visible_to(pkg):
    """The default_visibility for the BUILD files of top-level package `pkg` (and its subpackages)."""
    if pkg not in LAYERS:
        fail("package %r is not in build_defs/layers.bzl LAYERS" % pkg)
    return ["//build_defs:may_use_" + pkg]
