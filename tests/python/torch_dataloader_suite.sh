#!/usr/bin/env bash
# PyTorch's own test/test_dataloader.py, unmodified, against forkguard.DataLoader (the harness in
# tests/peer-suites/torch-dataloader substitutes the class in every interpreter of the run), on
# the torch of $PYTHON (default /usr/bin/python3): 1.13.1's file on torch 1.13, 2.6.0's on torch
# 2.x (scripts/fetch-peer-suites fetches them from Debian's source packages into
# build/peer-suites; without them the test fails, saying so). The workers START names: "auto"
# (the default: forks, watched for CUDA where the suite's process asked torch.cuda.is_available()
# at import, which on torch 2.x's CUDA build sets torch's fork poison), "fork" (forks, whatever
# the process did) or "server" (clean workers, from each loader's own fork server). Passes when
# every test that passes with torch's own class (the harness's baseline for that torch, on this
# machine) passes, but those listed below with their reason (docs/python.md lists them too).
#
#   torch_dataloader_suite.sh START PYTHONPATH_DIR
#
# The harness is tests/peer-suites/torch-dataloader (another copy with FORKGUARD_PEER_SUITES=DIR);
# where it is absent the test says so and is skipped (exit 77).
set -euo pipefail
# In a /dev/shm of its own where a mount namespace is permitted (root, as CI): the suite's
# semaphores and torch's shared-memory tensors then neither meet other tests' nor are counted by
# their /dev/shm checks, so it need not take turns with them (tests/python/CMakeLists.txt asks the
# same question). What the run leaves there goes with the namespace.
if [ -z "${FORKGUARD_SUITE_OWN_SHM:-}" ] && unshare -m true 2>/dev/null; then
  export FORKGUARD_SUITE_OWN_SHM=1
  exec unshare -m sh -c 'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"' "$0" "$@"
fi
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
  auto|fork|server) ;;
  *) echo "START must be auto, fork or server, not $start" >&2; exit 2 ;;
esac
out=$(mktemp -d)
# The run's folder (pytest.log, junit.xml, outcomes.tsv) is kept when the check fails.
keep=""
trap '[ -n "$keep" ] || rm -rf "$out"' EXIT
rc=0
# forkguard_suite_exit (peer_suite_plugin/): pytest waits for the stdlib's resource tracker, which
# the suite's spawned processes start, so that the leak check below sees only what outlives it.
FORKGUARD_WORKER_START=$start "$suite/run.sh" -p "$pydir" -p "$here/peer_suite_plugin" \
  -o "$out/run" -t 1500 forkguard:DataLoader -- -p forkguard_suite_exit || rc=$?
if [ ! -s "$out/run/outcomes.tsv" ]; then
  echo "=== no outcomes from PyTorch's DataLoader suite (harness exit $rc): see the lines above"
  [ ! -s "$out/run/pytest.log" ] || { keep=1; echo "its pytest.log is kept in $out/run"; }
  exit 1
fi
torch=$(sed -n 's/^torch=//p' "$out/run/config.txt")
baseline=$(sed -n 's/^baseline=//p' "$out/run/config.txt")
if [ -z "$baseline" ]; then
  echo "=== no baseline of torch's own class for torch $torch in $suite/baseline: make one with" \
       "PYTHON=${PYTHON:-/usr/bin/python3} $suite/run.sh -o DIR torch (README.md)"
  keep=1
  exit 1
fi
# The tests expected to fail here, each with its reason, per start and torch. None: a fork-server
# worker receives the dataset's fork-context mp.Value (its memory's fd) and semaphores (named
# twins) as a forked one shares them (test_worker_seed*, test_get_worker_info).
case $start/$torch in
  *) expected="" ;;
esac
# Tests torch passes that did not pass here.
lost=$(join -t $'\t' -1 2 -2 2 \
  <(grep -v '^#' "$baseline" | awk -F'\t' '$1 == "passed"' | sort -t $'\t' -k2,2) \
  <(grep -v '^#' "$out/run/outcomes.tsv" | sort -t $'\t' -k2,2) |
  awk -F'\t' '$3 != "passed" {print $1}' | sort)
missing=$(comm -23 <(grep -v '^#' "$baseline" | awk -F'\t' '$1 == "passed" {print $2}' | sort) \
  <(grep -v '^#' "$out/run/outcomes.tsv" | cut -f2 | sort))
echo
echo "=== forkguard.DataLoader with worker_start=$start on torch $torch: pytest exit $rc"
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
  # pytest's headings read "____ TestClass.test_name ____".
  grep -A30 -E "^_+ ($(printf '%s\n' "$unexpected" | sed 's/::/\\./' | paste -sd'|')) _+$" \
    "$out/run/pytest.log" | head -120 || true
fi
if [ -n "$fixed" ]; then
  echo "listed as failing here but passed (take them off the list):"; printf '  %s\n' $fixed
  status=1
fi
if [ -s "$out/run/leaked.txt" ] && grep -qv '^#' "$out/run/leaked.txt"; then
  echo "processes outlived pytest:"; cat "$out/run/leaked.txt"; status=1
fi
[ $status -eq 0 ] || { keep=1; echo "the run's results are kept in $out/run"; }
[ $status -eq 0 ] && echo "every test torch's own class passes passed, but the $(printf '%s' "$expected" | grep -c . || true) listed"
exit $status
