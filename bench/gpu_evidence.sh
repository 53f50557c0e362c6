#!/usr/bin/env bash
# The GPU evidence for docs/benchmarks.md, on one machine, the same command each call (resumable:
# what finished is not run again while the machine stays warm; it goes back 30 s after a call ends,
# so chain the calls with no pause):
#
#     run(command="bash .gpu/env.sh bash bench/gpu_evidence.sh $OUT", carry=[".gpu"], timeout_s=600)
#
# First the recording (bench/server_sweep.py make, 1,000 steps) and the compile phase until done
# (~900 s of 16 cores with all four backends: two calls), then the FlashInfer libraries' mtimes; then
# the PARTS, in their order, a call stopping at the first it cannot finish:
#   eager     the eager sweep (slices of 250, --jobs 8)
#   graph     the --cuda-graph sweep
#   tests     the crash and plans GPU tests (bench/gpu_tests.sh)
#   cost      the check's cost before/after (bench/check_cost_before_after.sh: the before tree in .gpu/tree)
#   profile   the warm server mix's profile (bench/check_profile.py)
#   tlprofile the same inside --timeline's CUPTI collection (its cost per step, by function)
#   timeline  --timeline's cost, start-up against per step (bench/timeline_check.sh cost)
#   tlsteps   --timeline's cost per step in one warm process, against the before tree's (timeline_check.sh steps)
#   scale     the default command on the 1,000 steps, and memory from 1,000 to 5,000 steps
#             (bench/check_scale.py --recording --runs default,long)
#   plain     the default command as a user types it (no --backend: every backend here, fa3 too)
#   memdefault, memjobs16, memgraph, memidentity
#             workers sharing one GPU: the default command, --jobs 16, --cuda-graph, and --jobs 1
#             against the default on steps 0-149 (identical JSON); each says how many steps were
#             refused for memory (754 of 1,000 before the memory share)
#   rectl     `attndbg record --timeline` around a live transformers engine with CUDA graphs
#             (tests/gpu/test_timeline.py -k record; needs transformers >= 5.20 carried in .gpu/whl)
#   launchcost --timeline's collection per kernel launch (bench/timeline_launch_cost.py)
#   coldstart bench/cold_start.py on the recording's first step of each mode, both forms,
#             fresh JIT caches each, --backend COLD_BACKENDS (triton,flashinfer,mla): on a lane's share
#             of the cores, as a one-GPU machine has them
#   utilisation, command, startup
#             where the workers' wall time goes (bench/worker_utilisation.py; command: in `attndbg
#             check` itself, with its own start-up and report), and one worker's fixed cost split
#             (bench/worker_startup.py)
# and last the libraries' mtimes again (the checks must rebuild none). Everything in OUT/evidence.tgz.
# A part is finished when it ran to its end, whatever its verdict (its log says), not when its call's
# time cut it. Environment: LIMIT (seconds this call may use, default 575), PARTS (default
# eager,graph,tests,cost,profile,timeline), LANES (instead of PARTS, on a host of several GPUs:
# space-separated lists of parts, lane i on GPU i with 1/N of the cores, the lanes at once; the
# recording and the compile phase use the whole host first), DURING_COMPILE (parts that need no
# FlashInfer module, run on GPU 0 while the compile phase builds: rectl), BACKENDS (triton,flashinfer,fa3,mla), TIMELINE_BACKENDS
# (triton,flashinfer,fa3), COMPILE_STEPS (A:B: the compile phase for those steps only; the parts that
# check other steps compile theirs on first use). Issues 24/25's measurements alone, without fa3 (its 12 SM90 modules are
# 3/4 of the compile), about 900 s held:
#
#     PARTS=profile,timeline,scale BACKENDS=triton,flashinfer,mla TIMELINE_BACKENDS=triton,flashinfer bash bench/gpu_evidence.sh $OUT
#
# The workers-and-memory evidence on a 4-GPU host, one call (~6 min held without fa3):
#
#     LANES="memdefault,utilisation memidentity memjobs16,startup memgraph" BACKENDS=triton,flashinfer,mla bash bench/gpu_evidence.sh $OUT
set -u
out=${1:?usage: gpu_evidence.sh OUT}
T0=$(date +%s)
LIMIT=${LIMIT:-575}
BACKENDS=${BACKENDS:-triton,flashinfer,fa3,mla}
PARTS=${PARTS:-eager,graph,tests,cost,profile,timeline}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
rec=/tmp/attndbg_server_sweep/server_sweep_1000_seed0
res=/tmp/gpu_evidence; mkdir -p "$res"
pack() { (cd "$res" && tar czf "$out/evidence.tgz" --exclude='*.pt' .); }
trap pack EXIT
say() { echo "$*" | tee -a "$res/summary.txt"; }
# Bytecode for the wheels .gpu/env.sh installed with --no-compile, as pip's install writes it for
# users: else every process compiles FlashInfer's sources again (3.2 s of a worker's start, measured on an H200).
python -m compileall -q -j 0 /tmp/site attndbg backends > /dev/null 2>&1 || true
[ -f "$res/env.txt" ] || attndbg env > "$res/env.txt" 2>&1
[ -d "$rec" ] || python bench/server_sweep.py make -o "$rec" --steps 1000 --seed 0 > "$res/make.log" 2>&1
libraries() { find ~/.cache/flashinfer -name '*.so' -printf '%T@ %p\n' 2>/dev/null | sort -k2; }
# attempt PART SECONDS CMD...: CMD when more than SECONDS are left, under a timeout of what is left,
# its output in res/PART.log; the part is finished unless the timeout cut it.
attempt() {
  local part=$1 need=$2 s; shift 2
  # Said, not silent: an enclosure test once never started, and no line told.
  [ "$(left)" -gt "$need" ] || { say "$part: not started (needs $need s, $(left) s left in this call)"; return 1; }
  s=$(date +%s); timeout $(( $(left) - 10 )) "$@" > "$res/$part.log" 2>&1; local rc=$?
  say "$part: exit $rc after $(( $(date +%s) - s )) s, at $(( $(date +%s) - T0 )) s"; tail -12 "$res/$part.log"
  [ $rc -ne 124 ] && touch "$res/$part.done"
}
sweep() { # LABEL [--cuda-graph]: finished once all four slices are in
  local L=$(( $(left) - 10 )); [ $L -gt 60 ] || { say "$1 sweep: not started ($(left) s left in this call)"; return 1; }
  python bench/server_sweep.py run "$rec" --backend "$BACKENDS" ${2:-} --json "$res/$1.json" --jobs 8 --slice-steps 250 --timeout $L > "$res/run_$1.log" 2>&1
  say "$1 sweep: call ended at $(( $(date +%s) - T0 )) s with $(ls "$res/$1".steps-*.json 2>/dev/null | wc -l) of 4 slices"
  tail -14 "$res/run_$1.log"
  [ "$(ls "$res/$1".steps-*.json 2>/dev/null | wc -l)" -ge 4 ] && touch "$res/$1.done"
}
part_eager() { sweep eager; }
part_graph() { sweep graph --cuda-graph; }
part_tests() { # gpu_tests.sh resumes its own parts across calls: finished when both are
  [ "$(left)" -gt 90 ] || { say "tests: not started (needs 90 s, $(left) s left in this call)"; return 1; }
  mkdir -p "$res/tests"; LIMIT=$(( $(left) - 5 )) bash bench/gpu_tests.sh "$res/tests" crash,plans > "$res/gpu_tests.log" 2>&1
  tail -8 "$res/gpu_tests.log"
  ! grep -q -e ': exit 124 ' -e ': not started' "$res/gpu_tests.log" && touch "$res/tests.done"
}
part_cost() { attempt cost 230 bash bench/check_cost_before_after.sh "$res/cost"; }
# Where a warm worker's time goes on the server mix (one process, 60 steps profiled).
part_profile() { attempt profile 200 python bench/check_profile.py "$rec" --backend "$BACKENDS" --warmup 30 --steps 60 --out "$res" --tag _server; }
# The same profile inside --timeline's collection: where its per-step cost goes.
part_tlprofile() { attempt tlprofile 200 python bench/check_profile.py "$rec" --backend "$BACKENDS" --warmup 30 --steps 60 --out "$res" --tag _server_timeline --timeline /tmp/profile_timeline.json; }
# --timeline's cost, split into start-up and per step (needs cupti-python in .gpu).
# With a before tree in .gpu/tree (check_cost_before_after.sh's), its --timeline is timed in the same
# alternation, against this tree's.
before_tree() { [ -d .gpu/tree/attndbg ] && ln -sfn ../backends .gpu/tree/attndbg/backends && (cd .gpu/tree && pwd); }
part_timeline() {
  attempt timeline 240 env REC="$rec" BACKENDS="${TIMELINE_BACKENDS:-triton,flashinfer,fa3}" BEFORE="$(before_tree)" bash bench/timeline_check.sh "$res/timeline" cost
}
# The cost per step alone, in one warm process (plain, --timeline, the before tree's).
part_tlsteps() {
  attempt tlsteps 200 env REC="$rec" BACKENDS="${TIMELINE_BACKENDS:-triton,flashinfer,fa3}" BEFORE="$(before_tree)" bash bench/timeline_check.sh "$res/timeline_steps" steps
}
# The GPU enclosure test (tests/gpu/test_timeline.py on traces/, --backend all, eager and
# graph; the shipped traces' modules are built in the compile phase when this part is asked for).
# (83 s and 59 s on a warm H200 host, its 4 tests; the 400 s it once asked kept it from starting
# twice.)
part_tltest() { attempt tltest 200 bash bench/timeline_check.sh "$res/timeline_test" test; }
# The command as a user runs it on the whole mix, and host/GPU memory at 1,000 and 5,000 steps
# (SCALE_RUNS: check_scale.py's --runs; with jobs, --jobs SCALE_JOBS too).
part_scale() { attempt scale 150 python bench/check_scale.py --recording "$rec" --system-caches --backends "$BACKENDS" --runs "${SCALE_RUNS:-default,long}" --jobs "${SCALE_JOBS:-16}" --run-timeout "$(( $(left) - 20 ))" --out "$res/scale" --work /tmp/gpu_evidence_scale --tag _server; }
# Workers sharing one GPU. Each check's line: exit, wall, steps refused for memory, verdict.
checked_line() { # LABEL: what the check of part LABEL says, in the summary
  say "$1: refused for memory $(grep -c 'not replayed' "$res/$1.log"); $(grep '^checked ' "$res/$1.log" | cut -c1-300)"
}
checked() { # LABEL ARGS...: attndbg check REC ARGS as the part LABEL
  attempt "$1" 60 attndbg check "$rec" --backend "$BACKENDS" "${@:2}" || return 1
  checked_line "$1"
}
part_memdefault() { checked memdefault; }
# The "default command" as a user types it: no --backend, so every backend that runs here (fa3
# too: compile with BACKENDS=all first, or its modules compile inside this part's time).
part_plain() {
  attempt plain 90 attndbg check "$rec" || return 1
  checked_line plain
}
part_memjobs16() { checked memjobs16 --jobs 16; }
part_memgraph() { checked memgraph --cuda-graph; }
part_memidentity() { # --jobs 1 and the default --jobs (3 workers) on steps 0-149: identical JSON
  [ -f "$res/jobs1_150.done" ] || checked jobs1_150 --steps 0:150 --jobs 1 --json "$res/jobs1_150.json" || return 1
  [ -f "$res/default_150.done" ] || checked default_150 --steps 0:150 --json "$res/default_150.json" || return 1
  if cmp -s <(python -m json.tool --sort-keys "$res/jobs1_150.json") <(python -m json.tool --sort-keys "$res/default_150.json"); then
    say "memidentity: JSON of steps 0-149, --jobs 1 and default: identical"
  else
    say "memidentity: JSON of steps 0-149, --jobs 1 and default: DIFFERENT"
  fi
  touch "$res/memidentity.done"
}
# Where the workers' wall time goes (start-up, busy, waiting, tail), and one worker's fixed cost split.
part_utilisation() { attempt utilisation 120 python bench/worker_utilisation.py "$rec" --backend "$BACKENDS" --out "$res"; }
# The same split for `attndbg check` itself: start-up, before the pool, the pool, the report, exit.
part_command() { attempt command 120 python bench/worker_utilisation.py "$rec" --backend "$BACKENDS" --cli --out "$res"; }
# Record --timeline on a live engine (no FlashInfer: it can run during the compile phase).
part_rectl() { attempt rectl 120 env ATTNDBG_TIMELINE_OUT="$res/rectl" python -m pytest -q -s -p no:cacheprovider tests/gpu/test_timeline.py -k record; }
# --timeline's collection per kernel launch, alone: plain, CUPTI's buffers as memory,
# cupti-python's objects (no FlashInfer either: DURING_COMPILE too).
part_launchcost() { attempt launchcost 120 python bench/timeline_launch_cost.py --launches 20000 --repeats 3; }
# The cold start, each form on empty caches of its own (the lane's cores compile).
part_coldstart() { attempt coldstart 300 python bench/cold_start.py "$rec" "$res/coldstart" --backend "${COLD_BACKENDS:-triton,flashinfer,mla}" --form default --form compile-first --fresh-caches; }
part_startup() { attempt startup 60 python bench/worker_startup.py "$rec" --backend "$BACKENDS" --out "$res"; }
for part in $(tr ',' ' ' <<< "${LANES:-$PARTS} ${DURING_COMPILE:-}"); do
  declare -F "part_$part" >/dev/null || { echo "gpu_evidence.sh: no part $part (PARTS=$PARTS LANES=${LANES:-})"; exit 2; }
done
( while true; do echo "$(date +%T) nvcc=$(pgrep -c nvcc) ninja=$(pgrep -c ninja) load=$(cut -d' ' -f1 /proc/loadavg) so=$(ls ~/.cache/flashinfer/*/*/cached_ops/*/*.so 2>/dev/null | wc -l) gpu=$(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader | tr -d ' ' | tr '\n' ' ')"; sleep 10; done ) >> "$res/sampler.txt" 2>&1 &
sampler=$!
early=(); during=${DURING_COMPILE:-}
for part in ${during//,/ }; do
  [ -f "$res/$part.done" ] || { "part_$part" & early+=($!); }
done
if [ ! -f "$res/compile.done" ]; then
  s=$(date +%s)
  timeout $(( $(left) - 10 )) attndbg compile "$rec" --backend "$BACKENDS" ${COMPILE_STEPS:+--steps "$COMPILE_STEPS"} >> "$res/compile.log" 2>&1; rc=$?
  say "compile: exit $rc after $(( $(date +%s) - s )) s"
  [ $rc -eq 0 ] && touch "$res/compile.done"
fi
# (TRACES_IN_LANE=1: tltest's own compile of traces/ runs in its lane instead, on that lane's cores,
# while the other lanes measure: one call on a host of 2 GPUs.)
if [ -f "$res/compile.done" ] && [ ! -f "$res/compile_traces.done" ] && [ -z "${TRACES_IN_LANE:-}" ] && grep -qw tltest <<< "${LANES:-$PARTS}"; then
  s=$(date +%s)
  timeout $(( $(left) - 10 )) attndbg compile traces >> "$res/compile_traces.log" 2>&1; rc=$?
  say "compile traces/ (--backend all): exit $rc after $(( $(date +%s) - s )) s"
  [ $rc -eq 0 ] && touch "$res/compile_traces.done"
fi
[ ${#early[@]} -gt 0 ] && wait "${early[@]}"
[ -f "$res/compile.done" ] && [ ! -f "$res/libraries_after_compile.txt" ] && libraries > "$res/libraries_after_compile.txt"
# run_parts LIST: LIST's parts in order, stopping at the first it cannot finish.
run_parts() {
  local part
  for part in ${1//,/ }; do
    [ -f "$res/$part.done" ] || "part_$part" || break
  done
}
if [ -f "$res/compile.done" ]; then
  if [ -n "${LANES:-}" ]; then
    # Lane i on GPU i and its own share of the cores (a 16-core one-GPU machine's on a 4-GPU host
    # of 64), all lanes at once; --jobs auto counts the affinity, so it picks what it would there.
    read -ra lanes <<< "$LANES"; per=$(( $(nproc) / ${#lanes[@]} )); pids=()
    for i in "${!lanes[@]}"; do
      ( taskset -cp "$(( i * per ))-$(( (i + 1) * per - 1 ))" $BASHPID > /dev/null
        export CUDA_VISIBLE_DEVICES=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i "$i") MAX_JOBS=$per
        run_parts "${lanes[$i]}" ) &
      pids+=($!)
    done
    wait "${pids[@]}"  # not the sampler
  else
    run_parts "$PARTS"
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
