#!/usr/bin/env bash
# Sets everything up (scripts/bootstrap.sh) and runs the default experiment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec bazel run //tools:main -- "$@"
