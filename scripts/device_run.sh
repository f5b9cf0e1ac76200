#!/usr/bin/env bash
# Run lab commands on the lent GPU machine in one call, logging under $OUT.
#   bash scripts/device_run.sh 'sweep gemm --device h100 --dsl all' 'sweep gemm --device gb10 --emulate'
# Each argument is one `python -m lab ...` command line, or `scripts/NAME.py ARGS` run as a script. Carry .whl (wheels of the packages the
# image lacks: optuna and its needs, see README "Running on the GPU machine"); when the DSL parts of
# ../shared/gpu/pack.sh were unpacked on this warm machine, /opt/labsite/env.sh is sourced too.
# results/ is packed into $OUT/results.tgz after every command (also after a failing one).
# LAB_CMD_TIMEOUT=<s> limits each command; LAB_CALL_BUDGET=<s> limits the whole call (the device tool's own
# limit, e.g. 600): each command then gets at most what is left of it, less the margin the stop and the
# packing need, and a command with nothing left is skipped, so that the last results.tgz is always written.
set -uo pipefail
SECONDS=0
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LAB_CACHE_DIR="${LAB_CACHE_DIR:-/tmp/labcache}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed" >&2; exit 3; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
[ -f /opt/labsite/env.sh ] && source /opt/labsite/env.sh
# The copy of the tree sent there has no .git (or a stale one): a bundle of this repository, carried as
# .gpu/git (git bundle create .gpu/git/repo.bundle --all), gives gate --run the commits it rebuilds
# previous lane code from, and this checkout's commit. It stays in /tmp/labgit while the machine is warm.
[ -f .gpu/git/repo.bundle ] && rm -rf /tmp/labgit && git clone -q --bare .gpu/git/repo.bundle /tmp/labgit
# LAB_BRANCH=<branch of the bundle>: run the commands in that branch's tree instead of the one sent (a
# worktree under /tmp), so that one call can measure a branch beside main: results.tgz then holds that
# tree's results/, which `python -m lab merge` brings back like any other call's.
if [ -n "${LAB_BRANCH:-}" ]; then
  [ -d /tmp/labgit ] || { echo "LAB_BRANCH needs the bundle (.gpu/git)" >&2; exit 3; }
  wt="/tmp/labwt-${LAB_BRANCH//\//-}"
  rm -rf "$wt" && GIT_DIR=/tmp/labgit git worktree prune
  GIT_DIR=/tmp/labgit git worktree add -q --detach "$wt" "$LAB_BRANCH" || { echo "no branch $LAB_BRANCH in the bundle" >&2; exit 3; }
  cd "$wt"
  export LAB_GIT_COMMIT="$(GIT_DIR=/tmp/labgit git rev-parse --short "$LAB_BRANCH")"
  export PYTHONPATH="$PWD:$PYTHONPATH"   # this tree's lab and kernels first
fi
if [ -d /tmp/labgit ]; then
  export GIT_DIR=/tmp/labgit LAB_GIT_COMMIT="${LAB_GIT_COMMIT:-$(GIT_DIR=/tmp/labgit git rev-parse --short HEAD)}"
fi
# Rows of an earlier call on this warm machine, at the same commit and branch, come back into results/
# before the commands run (and are kept after each one), so that a later call's --seed-best and resumed
# studies see them: each call starts from a fresh tree, and on 2026-11-28 a confirm in a second call
# seeded two lanes with older bests because the first call's sweeps were absent from its tree.
# `lab merge` of several such calls is unchanged (it skips rows and trials the checkout already has).
keep=""
if [ -n "${LAB_GIT_COMMIT:-}" ]; then
  keep="${LAB_KEEP_DIR:-/tmp/labkeep}/${LAB_BRANCH:-tree}-${LAB_GIT_COMMIT}"
  if [ -d "$keep/results" ]; then
    mkdir -p results && cp -a "$keep/results/." results/ \
      && echo "results/: an earlier call's rows at ${LAB_GIT_COMMIT} restored from $keep" | tee -a "$OUT/log.txt"
  fi
fi
# TileLang finds nvcc through CUDA_HOME.
[ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c 'import torch, triton, optuna; print("torch", torch.__version__, "triton", triton.__version__, "optuna", optuna.__version__)'
  python3 -m lab list gemm --device h100
  python3 -m lab devices
} 2>&1 | tee "$OUT/env.txt"
rc=0
i=0
for cmd in "$@"; do
  i=$((i + 1))
  # No progress bar in logs: tqdm redraws would fill the reply's tail.
  extra=""; case "$cmd" in sweep*) extra="--no-progress";; esac
  case "$cmd" in scripts/*) run=(python3);; *) run=(python3 -m lab);; esac
  echo "=== [$i] ${run[*]} $cmd" | tee -a "$OUT/log.txt"
  # LAB_CMD_TIMEOUT (seconds) stops a command early enough for results.tgz to be written below.
  # Output goes to the log file, not through a pipe: a process the command leaves behind (the fault
  # campaign's killed sweep left its workers) would hold a pipe open and block the script forever
  # (2026-11-25: a call lost to its limit that way, rows and all); the log part is printed after.
  start=$(wc -c < "$OUT/log.txt")
  limit="${LAB_CMD_TIMEOUT:-0}"
  if [ -n "${LAB_CALL_BUDGET:-}" ]; then
    # 45 s margin: up to 30 s between the INT and the KILL of `timeout -k 30`, then the packing below.
    left=$((LAB_CALL_BUDGET - SECONDS - 45))
    if [ "$left" -lt 10 ]; then
      echo "=== [$i] skipped: ${SECONDS} s of the call's ${LAB_CALL_BUDGET} s budget are spent" | tee -a "$OUT/log.txt"
      rc=124
      continue
    fi
    if [ "$limit" -eq 0 ] || [ "$limit" -gt "$left" ]; then limit=$left; fi
  fi
  timeout -k 30 -s INT "$limit" "${run[@]}" $cmd $extra >> "$OUT/log.txt" 2>&1 < /dev/null
  r=$?
  tail -c +$((start + 1)) "$OUT/log.txt"
  echo "=== [$i] exit $r" | tee -a "$OUT/log.txt"
  [ "$r" -ne 0 ] && rc=$r
  # Packed after every command: a call killed at its limit still brings back what finished before.
  tar czf "$OUT/results.tgz.part" results && mv "$OUT/results.tgz.part" "$OUT/results.tgz"
  if [ -n "$keep" ]; then
    mkdir -p "$keep" && rm -rf "$keep/results.part" && cp -a results "$keep/results.part" \
      && rm -rf "$keep/results" && mv "$keep/results.part" "$keep/results"
  fi
done
exit $rc
