#!/usr/bin/env bash
# The wheel, installed into a clean venv, runs the README's first command and a default `check`
# from outside the source tree: what `pip install attndbg` gives a user, not the editable checkout
# (a package left out of the wheel fails here; tests/packaging checks the list itself).
# Run from the repository root with the CI venv active (its test extra brings setuptools).
set -euo pipefail
root="$(pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Built from a copy, so the checkout gets no build/ or egg-info.
mkdir "$work/src"
cp -r attndbg backends setup.py pyproject.toml README.md "$work/src/"
python -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src"
python3 -m venv "$work/venv"
# torch first and pinned: 2.13.0 is the CPU build on local disk; any other request downloads CUDA.
"$work/venv/bin/python" -m pip install -q "torch==2.13.0"
"$work/venv/bin/python" -m pip install -q "$work"/dist/attndbg-*.whl
cd /tmp
"$work/venv/bin/python" -c "import attndbg, sys; assert attndbg.__file__.startswith(sys.prefix), attndbg.__file__; print('attndbg from', attndbg.__file__)"
"$work/venv/bin/attndbg" replay "$root/traces/verify_tree.pt" --backend triton
"$work/venv/bin/attndbg" check "$root/traces/decode_gqa.pt"
