#!/usr/bin/env bash
# Check cost per step before and after a change, in one device call, alternating (a change must
# not make the check slower), with the JSON of each pair compared. The cost of --timeline is
# bench/timeline_check.sh's `cost`.
#
# Here, once: the before tree as an ignored folder that travels with .gpu, its adapters linked in:
#     rm -rf .gpu/tree && mkdir -p .gpu/tree && git archive BEFORE_COMMIT | tar x -C .gpu/tree
#     git rev-parse --short BEFORE_COMMIT > .gpu/before_commit; git rev-parse --short HEAD > .gpu/after_commit
# On the device (a warm-up run compiles first; a fresh machine needs about 150 s of it):
#     run(command="bash .gpu/env.sh bash bench/check_cost_before_after.sh $OUT", carry=[".gpu"], timeout_s=600)
# Environment: B (check's backend options, default --backend triton,flashinfer,fa3), STEPS (200, of
# bench/scale_recording.py's decode recording, as timeline_check.sh's cost uses).
set -u
out=${1:?usage: check_cost_before_after.sh OUT}
mkdir -p "$out" /tmp/cost
ln -sfn ../backends .gpu/tree/attndbg/backends
BEFORE=$(cd .gpu/tree && pwd)
rec=/tmp/cost_rec
[ -d "$rec" ] || python3 bench/scale_recording.py "$rec" --steps "${STEPS:-200}" >/dev/null
B=${B:-"--backend triton,flashinfer,fa3"}
run() { # TAG "PROGRAM": wall seconds of a check, its JSON kept as /tmp/cost/<tag>.json
  local tag=$1 s=$EPOCHREALTIME
  timeout 150 $2 check "$rec" $B --json /tmp/cost/$tag.json >/dev/null 2>/tmp/cost/$tag.err; local rc=$?
  awk -v t=$tag -v a="$s" -v b="$EPOCHREALTIME" -v rc=$rc 'BEGIN { printf "%-22s %.1f s (exit %d)\n", t, b - a, rc }'
}
{
  echo "attndbg check $rec (${STEPS:-200} steps) $B: wall seconds; before = $(cat .gpu/before_commit 2>/dev/null || echo .gpu/tree), after = $(cat .gpu/after_commit 2>/dev/null || echo this tree)"
  run warmup attndbg
  for i in 1 2 3; do
    run before_$i "env PYTHONPATH=$BEFORE:${PYTHONPATH:-} python3 -m attndbg"
    run after_$i attndbg
  done
} 2>&1 | tee "$out/cost.txt"
python3 - <<'PY' | tee -a "$out/cost.txt"
import json
def steps(p):
    return json.dumps(json.load(open(p))["steps"], sort_keys=True)
for i in (1, 2, 3):
    print(f"JSON steps before_{i} == after_{i}:", steps(f"/tmp/cost/before_{i}.json") == steps(f"/tmp/cost/after_{i}.json"))
PY
