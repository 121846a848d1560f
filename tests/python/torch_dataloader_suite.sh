#!/usr/bin/env bash
# PyTorch 1.13.1's own test/test_dataloader.py, unmodified, against forkguard.DataLoader (the
# harness in shared/peer-suites/torch-dataloader substitutes the class in every interpreter of
# the run), with the workers START names: "fork" (forks of the loader's process, what "auto"
# does on a fork-safe process) or "server" (children of the clean interpreter fork server, what
# "auto" does once CUDA is initialized). Passes when every test that passes with torch's own
# class (the harness's baseline on this machine) passes, but those listed below with their
# reason (docs/python.md lists them too).
#
#   torch_dataloader_suite.sh START PYTHONPATH_DIR
#
# The suite is tests/peer-suites/torch-dataloader (a copy of shared/peer-suites; another copy
# with FORKGUARD_PEER_SUITES=DIR); where it is absent the test says so and is skipped (exit 77).
set -euo pipefail
start=$1
pydir=$2
here=$(cd "$(dirname "$0")" && pwd)
suites=${FORKGUARD_PEER_SUITES:-$here/../peer-suites}
suite=$suites/torch-dataloader
if [ ! -x "$suite/run.sh" ]; then
  echo "skipped: PyTorch's DataLoader suite is not at $suite (set FORKGUARD_PEER_SUITES)"
  exit 77
fi
case $start in
  fork) expected="" ;;
  # Fork-context synchronization objects (mp.Value(lock=True), mp.Semaphore()) exist only in
  # forks of the process that made them: a fork-server worker cannot receive them, and the
  # loader raises TypeError naming the attribute (dataset.count).
  server) expected="TestDataLoader::test_get_worker_info
TestDataLoader::test_worker_seed
TestDataLoader::test_worker_seed_reproducibility
TestDataLoaderPersistentWorkers::test_get_worker_info
TestDataLoaderPersistentWorkers::test_worker_seed
TestDataLoaderPersistentWorkers::test_worker_seed_reproducibility" ;;
  *) echo "START must be fork or server, not $start" >&2; exit 2 ;;
esac
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
rc=0
# forkguard_suite_exit (peer_suite_plugin/): pytest waits for the stdlib's resource tracker, which
# the suite's spawned processes start, so that the leak check below sees only what outlives it.
FORKGUARD_WORKER_START=$start "$suite/run.sh" -p "$pydir" -p "$here/peer_suite_plugin" \
  -o "$out/run" -t 1500 forkguard:DataLoader -- -p forkguard_suite_exit || rc=$?
baseline=$suite/baseline/torch-1.13.1-cpu.tsv
# Tests torch passes that did not pass here.
lost=$(join -t $'\t' -1 2 -2 2 \
  <(grep -v '^#' "$baseline" | awk -F'\t' '$1 == "passed"' | sort -t $'\t' -k2,2) \
  <(grep -v '^#' "$out/run/outcomes.tsv" | sort -t $'\t' -k2,2) |
  awk -F'\t' '$3 != "passed" {print $1}' | sort)
missing=$(comm -23 <(grep -v '^#' "$baseline" | awk -F'\t' '$1 == "passed" {print $2}' | sort) \
  <(grep -v '^#' "$out/run/outcomes.tsv" | cut -f2 | sort))
echo
echo "=== forkguard.DataLoader with worker_start=$start: pytest exit $rc"
unexpected=$(comm -23 <(printf '%s\n' "$lost" | sed '/^$/d') \
  <(printf '%s\n' "$expected" | sed '/^$/d' | sort))
fixed=$(comm -13 <(printf '%s\n' "$lost" | sed '/^$/d') \
  <(printf '%s\n' "$expected" | sed '/^$/d' | sort))
status=0
if [ -n "$missing" ]; then
  echo "did not run (torch's baseline passes them):"; printf '  %s\n' $missing; status=1
fi
if [ -n "$unexpected" ]; then
  echo "FAILED here, passed by torch's own class:"; printf '  %s\n' $unexpected; status=1
  grep -A30 -E "^_+ ($(printf '%s' "$unexpected" | sed 's/.*:://' | paste -sd'|'))" \
    "$out/run/pytest.log" | head -120 || true
fi
if [ -n "$fixed" ]; then
  echo "listed as failing here but passed (take them off the list):"; printf '  %s\n' $fixed
  status=1
fi
if [ -s "$out/run/leaked.txt" ] && grep -qv '^#' "$out/run/leaked.txt"; then
  echo "processes outlived pytest:"; cat "$out/run/leaked.txt"; status=1
fi
[ $status -eq 0 ] && echo "every test torch's own class passes passed, but the $(printf '%s' "$expected" | grep -c . || true) listed"
exit $status
