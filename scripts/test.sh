#!/usr/bin/env bash
# Sets everything up (scripts/bootstrap.sh --test) and runs the whole test suite through Bazel.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --test
exec bazel test //... "$@"
