#!/usr/bin/env bash
# Not run by .ci/run (which tests the oldest supported transformers, .ci/install-transformers.sh):
# the transformers recorder's live tests against the newest release the adapter supports
# (tests/record/engines.py SUPPORTED), in a scratch venv. Run from the repository root.
set -euo pipefail
version="${1:-5.24.0}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
# torch first and pinned: 2.13.0 is the CPU build on local disk; any other request downloads CUDA.
"$work/venv/bin/python" -m pip install -q "torch==2.13.0" "setuptools>=70.1"
"$work/venv/bin/python" -m pip install -q --no-build-isolation -e ".[test]" "transformers==$version" "psutil==7.2.2"
ATTNDBG_REQUIRE_ENGINES=1 "$work/venv/bin/python" -m pytest -q -p no:cacheprovider tests/record/test_transformers_live.py
