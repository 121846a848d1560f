#!/usr/bin/env bash
# forkguard run under a real two-node Slurm cluster on this machine (tests/support/slurm/cluster):
#   a. srun -N 2 --ntasks-per-node 1 forkguard run --nproc-per-node 2: a 4-rank gloo world whose
#      rendezvous comes from Slurm alone (no MASTER_ADDR/MASTER_PORT anywhere);
#   b. the same from an sbatch script;
#   c. scancel of a running 2-node job: no rank outlives it;
#   d. forkguard run in a 2-node batch script outside srun: refused with the cure.
# Usage: slurm_test.sh BUILD_DIR SOURCE_DIR. Exit 77 (skipped) where the cluster cannot run.
# Every wait is bounded; all of them together stay under ctest's TIMEOUT (300 s), so the EXIT trap
# always gets to stop the cluster (a test killed by ctest could not).
set -euo pipefail
export LC_ALL=C  # EPOCHREALTIME with a decimal point

build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
cluster=$src/tests/support/slurm/cluster
fg=$build/bin/forkguard
rank_py=$src/tests/launch/slurm_rank.py
python=/usr/bin/python3

skip() {
  echo "skipped: $*"
  exit 77
}
for prog in slurmctld slurmd munged srun sbatch squeue scancel scontrol; do
  command -v "$prog" >/dev/null || skip "$prog is not installed (scripts/install-deps has Slurm)"
done
[ "$(id -u)" -eq 0 ] || skip "the Slurm cluster needs root"
"$python" -c 'import torch.distributed' 2>/dev/null || skip "no torch.distributed in $python"
[ -x "$fg" ] || { echo "not ok - no $fg: build first"; exit 1; }

# Run from inside a Slurm job, srun would take that job's variables as its own allocation.
mapfile -t slurm_vars < <(compgen -e | grep -E '^(SLURMD?|SBATCH|SRUN|SALLOC|SQUEUE)_' || true)
for var in "${slurm_vars[@]}"; do unset "$var"; done
unset MASTER_ADDR MASTER_PORT

scratch=$(mktemp -d)
# munged wants every directory above its socket searchable by all.
chmod 0711 "$scratch"
marker=forkguard-slurm-test-$$-$RANDOM  # in the command line of everything check c starts

# Whatever happens: no process of ours left, the cluster stopped, the scratch directory gone.
cleanup() {
  local rc=$? pids
  trap - EXIT INT TERM
  mapfile -t pids < <(pgrep -f -- "$marker" || true)
  if [ ${#pids[@]} -gt 0 ]; then
    echo "# killing leftover processes: ${pids[*]}"
    kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  "$cluster" stop "$scratch/cluster" || rc=1
  rm -rf "$scratch"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

rc=0
"$cluster" start "$scratch/cluster" || rc=$?
if [ $rc -eq 77 ]; then skip "the Slurm cluster cannot run on this machine (see above)"; fi
if [ $rc -ne 0 ]; then echo "not ok - cluster start"; exit 1; fi
eval "$("$cluster" env "$scratch/cluster")"
cd "$scratch"

failures=0
ok() { echo "ok - $1"; }
not_ok() {
  echo "not ok - $1"
  failures=$((failures + 1))
}
now_us() { echo "${EPOCHREALTIME/./}"; }
seconds() { printf '%d.%03d' $(($1 / 1000000)) $(($1 % 1000000 / 1000)); }  # seconds MICROSECONDS
indent() { sed 's/^/#   /'; }
show() {  # show FILE: a file's content, indented, in a failure's details
  echo "# --- $1:"
  indent <"$1" 2>/dev/null || true
}

# What slurm_rank.py prints on each of the 4 ranks of job JOB: ranks 0-1 on n1 (node 0), 2-3 on
# n2; MASTER_ADDR is the first host of the job's node list n[1-2]; MASTER_PORT is derived from
# the job ID (10000 + ID mod 10000, include/forkguard/launch/environment.hpp).
expected_ranks() {  # expected_ranks JOB
  local r
  for r in 0 1 2 3; do
    echo "slurm_rank node=n$((r / 2 + 1)) job=$1 sum=10 RANK=$r LOCAL_RANK=$((r % 2))" \
      "GROUP_RANK=$((r / 2)) WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 MASTER_ADDR=n1" \
      "MASTER_PORT=$((10000 + $1 % 10000))"
  done
}

# check_ranks NAME OUTPUT JOB: OUTPUT holds exactly the expected rank lines.
check_ranks() {
  local actual expected
  actual=$(grep -o 'slurm_rank .*' "$2" | sort || true)
  expected=$(expected_ranks "$3" | sort)
  if [ "$actual" = "$expected" ]; then
    ok "$1"
    indent <<<"$actual"
    return 0
  fi
  not_ok "$1"
  echo "# expected:"
  indent <<<"$expected"
  echo "# got:"
  indent <<<"${actual:-(no rank line)}"
  return 1
}

# --- a. srun: every node's forkguard takes its place and the rendezvous from Slurm.
name="srun -N 2 --ntasks-per-node 1 forkguard run --nproc-per-node 2: 4 gloo ranks"
rc=0
timeout 45 srun -N 2 --ntasks-per-node 1 --kill-on-bad-exit=1 --job-name=slurm-test-a \
  "$fg" run --nproc-per-node 2 -- "$python" "$rank_py" >a.out 2>a.err || rc=$?
job=$(grep -o -m1 'slurm_rank node=[^ ]* job=[0-9]*' a.out | sed 's/.*job=//' || true)
if [ $rc -ne 0 ]; then
  not_ok "$name (exit code $rc)"
  show a.out
  show a.err
elif ! check_ranks "$name" a.out "${job:-0}"; then
  show a.out
  show a.err
fi

# --- b. sbatch: the batch script runs srun, as a user's would; its output file holds the ranks.
name="sbatch -N 2 --ntasks-per-node=1 of srun forkguard run: 4 gloo ranks in the output file"
cat >b.sbatch <<EOF
#!/bin/bash
#SBATCH -N 2
#SBATCH --ntasks-per-node=1
#SBATCH --job-name=slurm-test-b
#SBATCH --output=$scratch/b.out
#SBATCH --time=2
srun --kill-on-bad-exit=1 "$fg" run --nproc-per-node 2 -- "$python" "$rank_py"
EOF
# Polled rather than `sbatch --wait`, which looks every 10 s or so.
job=$(timeout 10 sbatch --parsable b.sbatch || true)
state=
info=
deadline=$((SECONDS + 45))
while [ -n "$job" ] && ((SECONDS < deadline)); do
  info=$(timeout 5 scontrol -o show job "$job" 2>/dev/null || true)
  state=$(grep -o 'JobState=[A-Z_]*' <<<"$info" | cut -d= -f2 || true)
  case $state in PENDING | CONFIGURING | RUNNING | COMPLETING | "") sleep 0.2 ;; *) break ;; esac
done
exit_code=$(grep -o ' ExitCode=[0-9:]*' <<<"$info" | cut -d= -f2 || true)
if [ "$state" != COMPLETED ] || [ "$exit_code" != 0:0 ]; then
  not_ok "$name (job ${job:-not submitted}: JobState=${state:-?} ExitCode=${exit_code:-?})"
  show b.out
  if [ -n "$job" ] && [ "$state" != COMPLETED ]; then
    timeout 5 scancel "$job" 2>/dev/null || true
  fi
else
  check_ranks "$name" b.out "$job" || show b.out
fi

# running PID: the process exists and is not a zombie (a zombie runs nothing; on some machines
# PID 1 is slow to reap the orphans it inherits).
running() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}
# alive PID...: how many of them are running.
alive() {
  local p n=0
  for p in "$@"; do if running "$p"; then n=$((n + 1)); fi; done
  echo "$n"
}
# "PID COMM" of every running process whose command line holds the marker.
marked_processes() {
  local p
  for p in $(pgrep -f -- "$marker" || true); do
    if running "$p"; then echo "$p $(cat "/proc/$p/comm" 2>/dev/null)"; fi
  done
}

# --- c. scancel: Slurm sends SIGCONT and SIGTERM to each node's forkguard (only its process
# group: proctrack/pgid does not see the ranks' own groups), SIGKILL KillWait (5 s) later. The
# launchers must pass the SIGTERM to their ranks and end them all. Measured: the time from scancel
# until the last rank is gone and until the job has left squeue (each the first poll that saw it:
# polls are 20 ms apart plus one squeue call), and that no rank nor launcher is running 1 s after
# the job has left squeue.
name="scancel of a 2-node forkguard run: every rank stops by SIGTERM, none outlives the job"
mkdir c
timeout 60 srun -N 2 --ntasks-per-node 1 --job-name="$marker" \
  "$fg" run --nproc-per-node 2 -- "$python" "$rank_py" --hold "$scratch/c" "$marker" \
  >c.out 2>c.err &
srun_pid=$!
deadline=$((SECONDS + 30))
while (($(find c -name 'rank*.pid' | wc -l) < 4)) && ((SECONDS < deadline)); do
  kill -0 "$srun_pid" 2>/dev/null || break
  sleep 0.1
done
mapfile -t rank_pids < <(cat c/rank*.pid 2>/dev/null)
job=$(squeue -h -n "$marker" -o %i)
if [ ${#rank_pids[@]} -ne 4 ] || [ -z "$job" ]; then
  not_ok "$name (${#rank_pids[@]} of 4 ranks started, job '${job}')"
  show c.out
  show c.err
else
  t0=$(now_us)
  t_ranks=
  t_left=
  timeout 5 scancel "$job"
  deadline=$((SECONDS + 20))
  while ((SECONDS < deadline)); do
    if [ -z "$t_ranks" ] && (($(alive "${rank_pids[@]}") == 0)); then t_ranks=$(now_us); fi
    if [ -z "$(squeue -h -j "$job" 2>/dev/null)" ]; then
      t_left=$(now_us)
      break
    fi
    sleep 0.02
  done
  # From the moment the job left squeue, up to 1 s for every rank and launcher to be gone; srun
  # (and the timeout around it) may still be printing its summary: it is waited for below.
  while :; do
    if [ -z "$t_ranks" ] && (($(alive "${rank_pids[@]}") == 0)); then t_ranks=$(now_us); fi
    mapfile -t stragglers < <(marked_processes | grep -v -e ' srun$' -e ' timeout$' || true)
    [ ${#stragglers[@]} -eq 0 ] && break
    (($(now_us) - ${t_left:-$t0} < 1000000)) || break
    sleep 0.02
  done
  t_end=$(now_us)
  srun_rc=0
  wait "$srun_pid" || srun_rc=$?
  sigterm=$(cat c/rank*.signal 2>/dev/null | grep -c '^SIGTERM ' || true)
  if [ -n "$t_ranks" ]; then
    timing="ranks gone $(seconds $((t_ranks - t0))) s after scancel"
  else
    timing="$(alive "${rank_pids[@]}") of 4 ranks still running"
    timing+=" $(seconds $((t_end - t0))) s after scancel"
  fi
  if [ -n "$t_left" ]; then timing+=", job left squeue after $(seconds $((t_left - t0))) s"; fi
  timing+=", last look for stragglers at $(seconds $((t_end - t0))) s"
  failed_before=$failures
  if [ -z "$t_left" ]; then
    not_ok "$name (job $job still in squeue 20 s after scancel; running: ${stragglers[*]:-none}; \
$timing)"
  elif [ ${#stragglers[@]} -gt 0 ]; then
    not_ok "$name (alive 1 s after the job left squeue: ${stragglers[*]}; $timing)"
  elif [ "$sigterm" -ne 4 ]; then
    not_ok "$name ($sigterm of 4 ranks got SIGTERM before dying; $timing)"
  else
    ok "$name"
    echo "# $timing; srun exit code $srun_rc"
  fi
  if ((failures > failed_before)); then
    show c.out
    show c.err
    for f in c/rank*.signal; do [ -e "$f" ] && show "$f"; done
  fi
fi

# --- d. forkguard run straight in the batch script of a 2-node job (no srun): refused at once with
# the cure (exit 2), instead of node 0 waiting for nodes that never start.
name="forkguard run in a 2-node batch script without srun: refused with exit 2 and the cure"
cat >d.sbatch <<EOF
#!/bin/bash
#SBATCH -N 2
#SBATCH --job-name=slurm-test-d
#SBATCH --output=$scratch/d.out
#SBATCH --time=1
timeout 20 "$fg" run --nproc-per-node 2 -- "$python" "$rank_py"
echo "exit code \$?"
EOF
job=$(timeout 10 sbatch --parsable d.sbatch || true)
deadline=$((SECONDS + 30))
while [ -n "$job" ] && ((SECONDS < deadline)) && [ -n "$(squeue -h -j "$job" 2>/dev/null)" ]; do
  sleep 0.2
done
if grep -q 'this is the batch script of a 2-node Slurm job (SLURM_NNODES=2)' d.out 2>/dev/null &&
  grep -q 'srun --ntasks-per-node=1 forkguard run' d.out && grep -qx 'exit code 2' d.out; then
  ok "$name"
else
  not_ok "$name (job ${job:-not submitted})"
  show d.out
fi

echo "# $failures failed"
[ $failures -eq 0 ]
