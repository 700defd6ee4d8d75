#!/usr/bin/env bash
# Makes a fresh Debian machine ready: Bazel (Debian's bazel-bootstrap) and the project's .venv with
# the pinned requirements. Idempotent and quick when done. The sandboxes need no package: their
# spawn helper (envs/sandbox/spawner.py) sets up the namespaces under the system python3.
#
#   scripts/bootstrap.sh          runtime requirements
#   scripts/bootstrap.sh --test   runtime and test requirements (requirements-test.txt, then
#                                 requirements-xm.txt without dependency resolution)
#   scripts/bootstrap.sh --gpu    also jax's CUDA 12 build for NVIDIA GPUs (requirements-gpu.txt:
#                                 the same jax version, its CUDA plugin and the CUDA libraries as
#                                 wheels); combines with --test. Nothing else changes on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
want_gpu=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --gpu) want_gpu=1 ;;
    *) echo "bootstrap: unknown flag '$arg' (known: --test, --gpu)" >&2; exit 2 ;;
  esac
done

sudo_cmd=()
if [[ "$(id -u)" != 0 ]] && command -v sudo >/dev/null; then sudo_cmd=(sudo); fi

missing=()
command -v bazel >/dev/null || missing+=(bazel-bootstrap)
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then missing+=(python3-venv); fi
if (( ${#missing[@]} )); then
  echo "bootstrap: installing ${missing[*]} with apt-get"
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi

req=requirements.txt
(( want_test )) && req=requirements-test.txt
stamp=".venv/.installed-$(cat requirements.txt requirements-test.txt requirements-xm.txt | sha256sum | cut -c1-16)-$want_test"
if [[ ! -f "$stamp" ]]; then
  [[ -x .venv/bin/python3 ]] || python3 -m venv .venv
  echo "bootstrap: installing $req into .venv"
  .venv/bin/python3 -m pip install -q --disable-pip-version-check -r "$req"
  if (( want_test )); then
    # xmanager for the XManager adapter's test, pinned with what it imports and without pip's
    # resolution of its own requirements (protobuf<7, cloud clients): see requirements-xm.txt.
    echo "bootstrap: installing requirements-xm.txt (--no-deps) into .venv"
    .venv/bin/python3 -m pip install -q --disable-pip-version-check --no-deps -r requirements-xm.txt
  fi
  rm -f .venv/.installed-*
  touch "$stamp"
  # A test install also satisfies the runtime one.
  (( want_test )) && touch "${stamp%-1}-0"
fi

if (( want_gpu )); then
  # Its own stamp: the CPU install above leaves it alone unless it reinstalls (then it goes too,
  # and this reinstalls the plugin for the jax that requirements.txt now pins).
  gpu_hash=$(cat requirements.txt requirements-gpu.txt | sha256sum | cut -c1-16)
  gpu_stamp=".venv/.installed-gpu-$gpu_hash"
  if [[ ! -f "$gpu_stamp" ]]; then
    echo "bootstrap: installing requirements-gpu.txt (jax's CUDA build) into .venv"
    .venv/bin/python3 -m pip install -q --disable-pip-version-check -r requirements-gpu.txt
    touch "$gpu_stamp"
  fi
  .venv/bin/python3 -c 'import jax; print(f"bootstrap: jax {jax.__version__} runs on "
                                          f"{jax.default_backend()}: {jax.devices()}")'
fi
echo "bootstrap: ready"
