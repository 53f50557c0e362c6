#!/usr/bin/env bash
# bench/server_sweep.py on the device, within its per-call limit and resumable across calls.
#
# The device machine keeps /tmp while it stays warm (it is handed back 30 s after a call ends), so
# calls made one after another continue where the last one stopped: the recording is made once, then
# the check runs in slices that are each checked once (server_sweep.py --slice-steps); a slice cut
# by the call's limit is checked again from its start, so keep slices small while caches are cold.
# With COMPILE=1 the compile phase (attndbg compile) runs first, until it finishes; it resumes across
# calls (each module's finished objects stay on disk). Until session 10 it built every module in one
# ninja, and the check then rebuilt each module at its first load (bench/results/gpu_session10.md);
# now each module builds in its own directory. The recording's 41 modules need ~800 s of a 16-core
# machine either way (bench/compile_schedule.py). Without COMPILE the check's workers build them as
# their steps need them.
# Each call copies what it has to OUT.
#
#     run(command="bash .gpu/env.sh bash bench/server_sweep_gpu.sh $OUT eager,graph", carry=[".gpu"], timeout_s=600)
#
# Environment: LIMIT (seconds this call may use, default 560), STEPS (1000), SEED (0),
# BACKENDS (triton,flashinfer,fa3,mla), SLICE (100), JOBS (check --jobs, default 8: check's auto gives
# one worker per 50 steps, so a slice of 20 steps ran on one worker of 16 cores in session 9), COMPILE=1, PROFILE=1 (also bench/check_profile.py on a
# sample of the recording, once). Results in OUT: sweep.tgz (summaries, JSON and logs, no steps).
set -u
out=${1:?usage: server_sweep_gpu.sh OUT RUNS}
runs=${2:-eager,graph}
T0=$(date +%s)
LIMIT=${LIMIT:-560}
STEPS=${STEPS:-1000}
SEED=${SEED:-0}
BACKENDS=${BACKENDS:-triton,flashinfer,fa3,mla}
SLICE=${SLICE:-100}
JOBS=${JOBS:-8}
work=/tmp/attndbg_server_sweep
rec=$work/server_sweep_${STEPS}_seed${SEED}
res=/tmp/server_sweep_results
mkdir -p "$res"
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
pack() { (cd "$res" && tar czf "$out/sweep.tgz" --exclude='*.pt' .); ls -la "$out"; }
trap pack EXIT

[ -f "$res/env.txt" ] || attndbg env > "$res/env.txt" 2>&1
if [ ! -d "$rec" ]; then
  python bench/server_sweep.py make -o "$rec" --steps "$STEPS" --seed "$SEED" > "$res/make.log" 2>&1
  tail -12 "$res/make.log"
fi
if [ "${COMPILE:-0}" = 1 ] && [ ! -f "$res/compile.done" ]; then
  s=$(date +%s)
  timeout $(( $(left) - 20 )) attndbg compile "$rec" --backend "$BACKENDS" >> "$res/compile.log" 2>&1
  rc=$?
  echo "compile: exit $rc after $(( $(date +%s) - s )) s" | tee -a "$res/compile.log"
  grep -E "compiling|compile phase|attndbg compile" "$res/compile.log" | tail -8
  [ $rc -eq 0 ] && touch "$res/compile.done"
  [ $rc -eq 0 ] || exit 0  # the next call resumes the phase (its modules half-built stay on disk)
fi
if [ "${PROFILE:-0}" = 1 ] && [ ! -f "$res/check_profile_server.txt" ] && [ "$(left)" -gt 200 ]; then
  # One process, warm after 30 steps; 60 steps profiled, then timed without the profiler, by mode.
  timeout 180 python bench/check_profile.py "$rec" --backend "$BACKENDS" --warmup 30 --steps 60 --out "$res" --tag _server 2>&1 | tail -8
fi
for r in ${runs//,/ }; do
  L=$(( $(left) - 15 ))
  [ $L -gt 60 ] || break
  graph=(); [ "$r" = graph ] && graph=(--cuda-graph)
  python bench/server_sweep.py run "$rec" --backend "$BACKENDS" "${graph[@]}" --json "$res/server_sweep_$r.json" \
    --jobs "$JOBS" --slice-steps "$SLICE" --timeout "$L" > "$res/run_$r.log" 2>&1
  tail -30 "$res/run_$r.log"
done
echo "FlashInfer JIT builds during the checks: $(cat "$res"/*.steps-*.log 2>/dev/null | grep -c 'Building JIT module')"
