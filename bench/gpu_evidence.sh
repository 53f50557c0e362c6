#!/usr/bin/env bash
# The GPU evidence the open issues wait for, on one machine, the same command each call (resumable:
# what finished is not run again while the machine stays warm; it goes back 30 s after a call ends,
# so chain the calls with no pause):
#
#     run(command="bash .gpu/env.sh bash bench/gpu_evidence.sh $OUT", carry=[".gpu"], timeout_s=600)
#
# In order: the recording (bench/server_sweep.py make, 1,000 steps); the compile phase until done
# (~800 s of 16 cores: two calls), then the FlashInfer libraries' mtimes; the eager sweep (slices of
# 250, --jobs 8); the --cuda-graph sweep; the crash and plans GPU tests (bench/gpu_tests.sh); the
# check's cost before/after (bench/check_cost_before_after.sh: the before tree in .gpu/tree, see there);
# the warm server mix's profile (bench/check_profile.py); --timeline's cost (bench/timeline_check.sh);
# the libraries' mtimes again (the checks must rebuild none). Everything in OUT/evidence.tgz.
# Environment: LIMIT (seconds this call may use, default 575), BACKENDS (triton,flashinfer,fa3,mla).
set -u
out=${1:?usage: gpu_evidence.sh OUT}
T0=$(date +%s)
LIMIT=${LIMIT:-575}
BACKENDS=${BACKENDS:-triton,flashinfer,fa3,mla}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
rec=/tmp/attndbg_server_sweep/server_sweep_1000_seed0
res=/tmp/gpu_evidence; mkdir -p "$res"
pack() { (cd "$res" && tar czf "$out/evidence.tgz" --exclude='*.pt' .); }
trap pack EXIT
say() { echo "$*" | tee -a "$res/summary.txt"; }
[ -f "$res/env.txt" ] || attndbg env > "$res/env.txt" 2>&1
[ -d "$rec" ] || python bench/server_sweep.py make -o "$rec" --steps 1000 --seed 0 > "$res/make.log" 2>&1
( while true; do echo "$(date +%T) nvcc=$(pgrep -c nvcc) ninja=$(pgrep -c ninja) load=$(cut -d' ' -f1 /proc/loadavg) so=$(ls ~/.cache/flashinfer/*/*/cached_ops/*/*.so 2>/dev/null | wc -l) gpu=$(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader | tr -d ' ' | tr '\n' ' ')"; sleep 10; done ) >> "$res/sampler.txt" 2>&1 &
sampler=$!
libraries() { find ~/.cache/flashinfer -name '*.so' -printf '%T@ %p\n' 2>/dev/null | sort -k2; }
if [ ! -f "$res/compile.done" ]; then
  s=$(date +%s)
  timeout $(( $(left) - 10 )) attndbg compile "$rec" --backend "$BACKENDS" >> "$res/compile.log" 2>&1; rc=$?
  say "compile: exit $rc after $(( $(date +%s) - s )) s"
  [ $rc -eq 0 ] && touch "$res/compile.done" && libraries > "$res/libraries_after_compile.txt"
fi
sweep() { # LABEL [--cuda-graph]: true once all four slices are in
  local L=$(( $(left) - 10 )); [ $L -gt 60 ] || return 1
  python bench/server_sweep.py run "$rec" --backend "$BACKENDS" ${2:-} --json "$res/$1.json" --jobs 8 --slice-steps 250 --timeout $L > "$res/run_$1.log" 2>&1
  say "$1 sweep: call ended at $(( $(date +%s) - T0 )) s with $(ls "$res/$1".steps-*.json 2>/dev/null | wc -l) of 4 slices"
  tail -14 "$res/run_$1.log"
  [ "$(ls "$res/$1".steps-*.json 2>/dev/null | wc -l)" -ge 4 ]
}
if [ -f "$res/compile.done" ]; then
  [ -f "$res/eager.done" ] || { sweep eager && touch "$res/eager.done"; }
  [ -f "$res/eager.done" ] && [ ! -f "$res/graph.done" ] && { sweep graph --cuda-graph && touch "$res/graph.done"; }
  if [ -f "$res/graph.done" ] && [ ! -f "$res/tests.done" ] && [ "$(left)" -gt 90 ]; then
    mkdir -p "$res/tests"; LIMIT=$(( $(left) - 5 )) bash bench/gpu_tests.sh "$res/tests" crash,plans > "$res/gpu_tests.log" 2>&1 && touch "$res/tests.done"
    tail -8 "$res/gpu_tests.log"
  fi
  if [ -f "$res/graph.done" ] && [ ! -f "$res/cost.done" ] && [ "$(left)" -gt 230 ]; then
    bash bench/check_cost_before_after.sh "$res/cost" > "$res/cost.log" 2>&1 && touch "$res/cost.done"
    say "cost before/after: done at $(( $(date +%s) - T0 )) s"; tail -5 "$res/cost/cost.txt"
  fi
  if [ -f "$res/cost.done" ] && [ ! -f "$res/check_profile_server.txt" ] && [ "$(left)" -gt 200 ]; then
    # Issue 24: where a warm worker's time goes on the server mix (one process, 60 steps profiled).
    timeout $(( $(left) - 10 )) python bench/check_profile.py "$rec" --backend "$BACKENDS" --warmup 30 --steps 60 --out "$res" --tag _server > "$res/profile.log" 2>&1
    tail -4 "$res/profile.log"
  fi
  if [ -f "$res/check_profile_server.txt" ] && [ ! -f "$res/timeline/timeline_cost.txt" ] && [ "$(left)" -gt 300 ]; then
    # Issue 25: --timeline's cost, split into start-up and per step (needs cupti-python in .gpu).
    timeout $(( $(left) - 10 )) bash bench/timeline_check.sh "$res/timeline" cost > "$res/timeline.log" 2>&1
    tail -12 "$res/timeline.log"
  fi
  libraries > "$res/libraries_after_checks.txt"
  [ -f "$res/libraries_after_compile.txt" ] && if cmp -s "$res/libraries_after_compile.txt" "$res/libraries_after_checks.txt"; then
    say "FlashInfer libraries: none rewritten or added since the compile phase"
  else
    say "FlashInfer libraries: CHANGED since the compile phase (diff the two lists)"
  fi
fi
kill $sampler
say "call ended at $(( $(date +%s) - T0 )) s"
