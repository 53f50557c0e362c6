#!/usr/bin/env bash
# Issue 24/25's measurements on the server mix, one machine, the same command each call (resumable
# while the machine stays warm; it goes back 30 s after a call ends, so chain the calls):
#
#     run(command="bash .gpu/env.sh bash bench/gpu_mix_measure.sh $OUT", carry=[".gpu"], timeout_s=600)
#
# With BACKENDS (default triton,flashinfer,mla: without fa3, whose 12 SM90 modules are 3/4 of the
# ~900 s compile of all four): the compile phase; the warm mix's profile (bench/check_profile.py);
# --timeline's cost split into start-up and per step (bench/timeline_check.sh cost, on its
# decode-only recording, triton,flashinfer); the default command on the 1,000 steps and memory from
# 1,000 to 5,000 steps (bench/check_scale.py --recording --runs default,long). Everything in
# OUT/mix.tgz. LIMIT: seconds this call may use (default 580).
set -u
out=${1:?usage: gpu_mix_measure.sh OUT}
T0=$(date +%s); LIMIT=${LIMIT:-580}
B=${BACKENDS:-triton,flashinfer,mla}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
res=/tmp/gpu_mix; mkdir -p "$res"
pack() { (cd "$res" && tar czf "$out/mix.tgz" --exclude='*.pt' --exclude='*.prof' .); }
trap pack EXIT
rec=/tmp/attndbg_server_sweep/server_sweep_1000_seed0
[ -f "$res/env.txt" ] || attndbg env > "$res/env.txt" 2>&1
[ -d "$rec" ] || python bench/server_sweep.py make -o "$rec" --steps 1000 --seed 0 > "$res/make.log" 2>&1
( while true; do echo "$(date +%T) load=$(cut -d' ' -f1 /proc/loadavg) gpu=$(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader | tr -d ' ')"; sleep 5; done ) >> "$res/sampler.txt" 2>&1 &
sampler=$!
if [ ! -f "$res/compile.done" ]; then
  s=$(date +%s); timeout $(( $(left) - 10 )) attndbg compile "$rec" --backend "$B" >> "$res/compile.log" 2>&1; rc=$?
  echo "compile $B: exit $rc after $(( $(date +%s) - s )) s"; [ $rc -eq 0 ] && touch "$res/compile.done"
fi
if [ -f "$res/compile.done" ] && [ ! -f "$res/check_profile_server.txt" ] && [ "$(left)" -gt 120 ]; then
  timeout $(( $(left) - 10 )) python bench/check_profile.py "$rec" --backend "$B" --warmup 30 --steps 60 --out "$res" --tag _server > "$res/profile.log" 2>&1
  tail -3 "$res/profile.log"
fi
if [ -f "$res/check_profile_server.txt" ] && [ ! -f "$res/timeline/timeline_cost.txt" ] && [ "$(left)" -gt 240 ]; then
  mkdir -p "$res/timeline"; BACKENDS=triton,flashinfer timeout $(( $(left) - 10 )) bash bench/timeline_check.sh "$res/timeline" cost > "$res/timeline.log" 2>&1
  tail -14 "$res/timeline.log"
fi
if [ -f "$res/timeline/timeline_cost.txt" ] && [ ! -f "$res/scale/check_scale_server.json" ] && [ "$(left)" -gt 150 ]; then
  timeout $(( $(left) - 10 )) python bench/check_scale.py --recording "$rec" --system-caches --backends "$B" --runs default,long --out "$res/scale" --work /tmp/gpu_mix_work --tag _server > "$res/scale.log" 2>&1
  tail -5 "$res/scale.log"
fi
kill $sampler
echo "call ended at $(( $(date +%s) - T0 )) s"
