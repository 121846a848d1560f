#!/usr/bin/env bash
# GPU check: the probe's verdict transitions, the launcher, the loader's device hand-off,
# forkguard trace and the Python package against the real CUDA driver.
# Run on a machine with an NVIDIA GPU after `make build`:   tests/gpu/run.sh [build/release]
# Where there is no GPU it says so and exits 0. `--fake` runs the same checks against the test
# driver (to check this script itself on a machine without a GPU).
set -uo pipefail
fake=0
if [ "${1:-}" = "--fake" ]; then fake=1; shift; fi
build=$(cd "${1:-build/release}" && pwd) || { echo "tests/gpu: no build directory ${1:-build/release}"; exit 1; }
fg=$build/bin/forkguard
stage=$build/bin/helpers/cuda_stage

[ -x "$fg" ] && [ -x "$stage" ] || { echo "tests/gpu: build first (make build)"; exit 1; }
unset FORKGUARD_CUDA_DRIVER FORKGUARD_NVML_LIBRARY CUDA_VISIBLE_DEVICES
if [ $fake -eq 1 ]; then
  export FORKGUARD_CUDA_DRIVER=$build/lib/fake_cuda/libcuda.so.1
  export FORKGUARD_NVML_LIBRARY=$build/lib/fake_cuda/libnvidia-ml.so.1
  FAKE_CUDA_DEV_DIR=$(mktemp -d); export FAKE_CUDA_DEV_DIR
  export FAKE_CUDA_COPY_DELAY_MS=2  # async copies really are asynchronous
  trap 'rm -rf "$FAKE_CUDA_DEV_DIR"' EXIT
  echo "tests/gpu: --fake: checking against the test driver"
elif [ ! -e /dev/nvidiactl ] || ! ldconfig -p | grep -q 'libcuda.so.1 '; then
  echo "tests/gpu: no NVIDIA GPU or driver on this machine (no /dev/nvidiactl or libcuda.so.1): skipped"
  exit 0
fi

fail=0
check() {  # check NAME EXPECTED ACTUAL
  if [ "$2" = "$3" ]; then echo "ok   $1: $3"; else echo "FAIL $1: expected '$2', got '$3'"; fail=1; fi
}

# The helper on a pair of FIFOs (plain fds 3 and 4 stay usable in $(...) subshells).
fifos=$(mktemp -d)
mkfifo "$fifos/in" "$fifos/out"
"$stage" <"$fifos/in" >"$fifos/out" &
hjob=$!
exec 3>"$fifos/in" 4<"$fifos/out"
rm -rf "$fifos"
ask() { echo "$1" >&3; IFS= read -r reply <&4; echo "$reply"; }
hpid=$(ask pid | cut -d' ' -f2)
verdict_of_json() { sed -n 's/^  "verdict": "\([a-z_]*\)",\{0,1\}$/\1/p' | head -1; }
outside() { "$fg" doctor --pid "$1" --json | verdict_of_json; }
inside() { ask probe | cut -d' ' -f2; }

check "clean (inside)" clean "$(inside)"
check "clean (outside)" clean "$(outside "$hpid")"
check "load" ok "$(ask load)"
check "driver_loaded (inside)" driver_loaded "$(inside)"
check "driver_loaded (outside)" driver_loaded "$(outside "$hpid")"
check "init" ok "$(ask init)"
check "initialized (inside)" initialized "$(inside)"
check "initialized (outside)" initialized "$(outside "$hpid")"
echo "driver threads after cuInit:"; cat /proc/"$hpid"/task/*/comm | sort | uniq -c | sed 's/^/    /'
echo "device files open after cuInit:"; ls -l /proc/"$hpid"/fd | grep -o '/[^ ]*nvidia[-a-z0-9]*$' | sort | uniq -c | sed 's/^/    /'
echo "device files mapped after cuInit:"; grep -o '/[^ ]*nvidia[-a-z0-9]*$' /proc/"$hpid"/maps | sort | uniq -c | sed 's/^/    /'
check "ctx" ok "$(ask ctx)"
check "context_active (inside)" context_active "$(inside)"
check "context_active (outside)" context_active "$(outside "$hpid")"
echo "device files mapped with a context:"; grep -o '/[^ ]*nvidia[-a-z0-9]*$' /proc/"$hpid"/maps | sort | uniq -c | sed 's/^/    /'
child=$(ask fork | cut -d' ' -f2)
check "poisoned child (inside)" poisoned "$(inside)"
check "poisoned child (outside)" poisoned "$(outside "$child")"
check "child cuInit fails" "error CUDA_ERROR_NOT_INITIALIZED" "$(ask init)"
check "parent after child exit" "parent 0" "$(ask exit)"
echo exit >&3
exec 3>&- 4<&-
wait "$hjob"

# NVML: forkguard's GPU inventory (doctor) must not make a process fork-unsafe.
check "doctor self after NVML" clean "$("$fg" doctor --json | verdict_of_json)"
"$fg" doctor | sed -n '/^environment:/,$p'
# The launcher after the parent initialized CUDA: fork server and spawn ranks initialize CUDA,
# plain fork is refused before any child exists (exit 3).
nb=$build/bin/notebook_style
nranks=$("$fg" run --quiet --nproc-per-node gpu --no-prefix -- /bin/echo x 2>/dev/null | wc -l)
[ "$nranks" -ge 1 ] || nranks=1
for m in forkserver spawn; do
  out=$("$nb" --parent-touches-cuda --nproc "$nranks" --start-method $m 2>&1)
  check "notebook_style $m: ranks with cuda ok" "$nranks" "$(grep -c 'cuda ok' <<<"$out")"
done
"$nb" --parent-touches-cuda --nproc "$nranks" --start-method fork >/dev/null 2>&1
check "notebook_style fork after cuInit refused" 3 "$?"
out=$("$fg" run --quiet --nproc-per-node gpu --bind-gpus --no-prefix -- sh -c 'echo $CUDA_VISIBLE_DEVICES')
check "--nproc-per-node gpu --bind-gpus: one GPU each" "$nranks" "$(sort -u <<<"$out" | wc -l)"

# The loader: process workers from the fork server after the parent initialized CUDA, batches
# copied to the GPU (pinned slots, async copies, events) and compared byte for byte.
out=$("$build/bin/helpers/loader_gpu_check" 2>&1)
echo "$out" | sed 's/^/    /'
check "loader device hand-off" ok "$(grep -o '^loader-gpu [a-zA-Z]*' <<<"$out" | cut -d' ' -f2)"

# forkguard trace: a program that initializes CUDA and then forks a child that touches it gets
# the dirty-fork report naming its init site; with --strict the poisoned child exits 70.
tf=$build/bin/helpers/trace_fork
# In a sanitizer build the helper is instrumented and the preloaded library is not.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0"
out=$("$fg" trace -- "$tf" load init fork-touch 2>&1)
grep -q 'initialize_cuda_in_parent' <<<"$out" && r=named || r="not named: $out"
check "trace: dirty fork names the init site" named "$r"
"$fg" trace --strict --quiet -- "$tf" load init fork-touch >/dev/null 2>&1
check "trace --strict: poisoned child exits 70" 70 "$?"
out=$("$fg" trace --quiet -- "$tf" load init fork-exec 2>&1 >/dev/null)
[ -z "$out" ] && r=silent || r="reported: $out"
check "trace: fork-then-exec is silent" silent "$r"

# The Python package: ImageLoader(device="cuda") batches equal the host's byte for byte, and
# notebook_launch ranks initialize CUDA after the parent did.
if [ -d "$build/python/forkguard" ]; then
  out=$(PYTHONPATH=$build/python /usr/bin/python3 "$(dirname "$0")/python_gpu_check.py" 2>&1)
  echo "$out" | sed 's/^/    /'
  check "python: ImageLoader on the GPU, notebook_launch" ok \
    "$(grep -o '^python-gpu [a-zA-Z]*' <<<"$out" | cut -d' ' -f2)"
else
  echo "tests/gpu: no Python module in $build (sanitizer build?): Python checks skipped"
fi

[ $fail -eq 0 ] && echo "tests/gpu: all checks passed" || echo "tests/gpu: FAILURES"
exit $fail
