#!/usr/bin/env bash
# --timeline on the GPU: the enclosure test, timeline files of a replay, and the cost.
#
# Here (the CPU machine), once: wheels for the device, cupti-python among them (resolved to
# cupti_python-13.0.1 for the CUDA 13.0 driver; the image already has cuda-bindings and
# nvidia-cuda-cupti, which it needs):
#     EXTRA_WHEELS="cupti-python==13.0.*" bash ../shared/gpu/pack.sh
# On the device, two calls on one warm machine (each within the 10-minute limit; the second reuses
# the FlashInfer modules the first built):
#     run(command="bash .gpu/env.sh bash bench/timeline_check.sh $OUT test", carry=[".gpu"], timeout_s=600)
#     run(command="bash .gpu/env.sh bash bench/timeline_check.sh $OUT cost", carry=[".gpu"], timeout_s=600)
# Back in $OUT: from `test`, replay_traces_all_eager.json, replay_traces_all_graph.json,
# check_traces_jobs2.json (open in https://ui.perfetto.dev; .json.gz when over 4 MB), timeline_check.txt (per command: the
# counts the test checked, any problem, the printed summary), pytest.log; from `cost`,
# timeline_cost.txt.
set -uo pipefail
out=${1:?usage: timeline_check.sh OUT_DIR test|cost|steps}
what=${2:?usage: timeline_check.sh OUT_DIR test|cost|steps}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 ATTNDBG_TIMELINE_OUT="$out"
python3 -c "import cupti.cupti, importlib.metadata as m; print('cupti-python', m.version('cupti-python'))" || exit 1

if [ "$what" = test ]; then
  # FlashInfer's modules for the shipped traces, built at once (else the first replay compiles them one by one).
  timeout 200 attndbg compile traces 2>&1 | tail -3
  # 1. The enclosure test: replay traces/ --backend all, eager and --cuda-graph; check traces/ --jobs 2.
  timeout 360 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_timeline.py 2>&1 | tee "$out/pytest.log" | tail -15
  exit 0
fi

# steps: the cost per step alone (the bound that matters): one warm process each (bench/check_profile.py
# --no-profile: 30 steps to warm up, then 60 steps twice, the second pass timed step by step), plain,
# with --timeline, and with BEFORE's --timeline, alternating; REC and BACKENDS as for `cost`.
if [ "$what" = steps ]; then
  rec=${REC:?steps needs REC}; B=${BACKENDS:-triton,flashinfer,fa3}
  one() { # LABEL [PYTHONPATH-FIRST] [ARGS...]
    local label=$1 first=$2; shift 2
    env PYTHONPATH="${first:+$first:}${PYTHONPATH:-}" timeout 150 python3 bench/check_profile.py "$rec" --backend "$B" --warmup 30 --steps 60 --no-profile --out "$out/steps" --tag "_$label" "$@" > "$out/steps_$label.log" 2>&1
    echo "$label (exit $?): $(grep -m1 '^measured:' "$out/steps_$label.log")"
  }
  {
    echo "bench/check_profile.py $rec --backend $B --warmup 30 --steps 60 --no-profile: ms per step, warm, one process"
    for i in 1 2; do
      one "plain_$i" ""
      one "timeline_$i" "" --timeline /tmp/timeline_steps.json
      [ -n "${BEFORE:-}" ] && one "timeline_before_$i" "$BEFORE" --timeline /tmp/timeline_steps_before.json
    done
  } 2>&1 | tee "$out/timeline_steps.txt"
  exit 0
fi

# 2. The cost of --timeline per step: on REC (the server mix, bench/server_sweep.py make's) when
# given, else a recording of metadata-only decode steps (bs 1-64, kv 1-8192); its first 200 steps,
# checked as users run it, without and with --timeline (a warm-up run first, then alternating), wall
# time of the whole command. BEFORE: a before tree whose --timeline is timed in the same alternation.
rec=${REC:-/tmp/timeline_rec}
[ -d "$rec" ] || python3 bench/scale_recording.py "$rec" --steps 200 >/dev/null
B=${BACKENDS:-triton,flashinfer,fa3}
run() { local s=$EPOCHREALTIME; timeout 110 ${ATTNDBG:-attndbg} check "$rec" --backend "$B" "$@" >/dev/null 2>/tmp/timeline_err.txt; local rc=$?; awk -v a="$s" -v b="$EPOCHREALTIME" -v rc=$rc 'BEGIN { printf "%.1f s (exit %d)", b - a, rc }'; }
{
  echo "attndbg check $rec --steps 0:200 --backend $B: wall seconds"
  echo "warm-up:        $(run --steps 0:200)"
  for i in 1 2; do
    echo "plain $i:        $(run --steps 0:200)"
    echo "--timeline $i:   $(run --steps 0:200 --timeline /tmp/timeline_cost.json)"
    grep -A12 '^timeline: ' /tmp/timeline_err.txt | head -14
    # BEFORE (a tree, as check_cost_before_after.sh's .gpu/tree): --timeline of that code too, in
    # the same alternation, so a change to the collection is timed against what it replaces.
    [ -n "${BEFORE:-}" ] && echo "--timeline before ($(cat .gpu/before_commit 2>/dev/null)) $i: $(ATTNDBG="env PYTHONPATH=$BEFORE:${PYTHONPATH:-} python3 -m attndbg" run --steps 0:200 --timeline /tmp/timeline_cost_before.json)"
  done
  # Per step or per process? The same on a quarter of the steps and the same 4 workers (--jobs auto
  # gives 200 steps 4): what --timeline adds to both lengths alike is start-up (CUPTI in each
  # worker, the parent's merge), what grows with the steps is the per-step cost.
  # (With BEFORE, once: that call's question is before against after.)
  for i in $(seq 1 $([ -n "${BEFORE:-}" ] && echo 1 || echo 2)); do
    echo "plain, steps 0-49, --jobs 4, $i:      $(run --jobs 4 --steps 0:50)"
    echo "--timeline, steps 0-49, --jobs 4, $i: $(run --jobs 4 --steps 0:50 --timeline /tmp/timeline_cost50.json)"
  done
  ls -la /tmp/timeline_cost.json
} 2>&1 | tee "$out/timeline_cost.txt"
