#!/usr/bin/env bash
# The PyTorch DataLoader and forkguard's loader on the same files, in one run: same batch size (64),
# same number of workers (2), the same pipeline (decode, RandomResizedCrop 224, flip, normalize,
# float32 NCHW). PyTorch runs with 2 fork workers, fresh per epoch and persistent (its best two
# configurations on 2 cores); forkguard with 2 thread workers and 2 process workers (fork server).
# Also the full-size libjpeg-turbo decode-only rate of the same files on 2 threads (the ceiling).
# Prints the medians of 3 runs each and the ratios: forkguard's best against PyTorch's best, and
# against the decode-only ceiling; and forkguard's time to the first batch with process workers:
# the first loader's (its cores idle until then) and a fresh loader's after the epochs (PyTorch's
# first-batch figure is likewise the median of three fresh DataLoaders built one after another).
#   bench/compare_torch.sh DIR [BUILD]      (DIR: an ImageFolder, e.g. from ../shared/bench-data)
set -euo pipefail
dir=${1:?usage: bench/compare_torch.sh IMAGEFOLDER [BUILD]}
build=${2:-build/release}
here=$(cd "$(dirname "$0")" && pwd)
peer=$here/../../shared/bench-data/torch_loader_bench.py
[ -f "$peer" ] || peer=$here/../shared/bench-data/torch_loader_bench.py
fg=$build/bin/forkguard
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
field() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }

torch_out=$(/usr/bin/python3 "$peer" --root "$dir" --only 3,7 --runs 3 --out /tmp/forkguard-compare-torch.jsonl)
echo "$torch_out"
torch_ips=$(sed -n 's/.*float32[^:]*: *\([0-9.]*\) img\/s.*/\1/p' <<<"$torch_out" | sort -g | tail -1)

best=0
for kind in thread process; do
  ips=() firsts=() fresh=()
  for run in 1 2 3; do
    out=$("$fg" bench loader --data "$dir" --workers 2 --worker-kind $kind --epochs 2 --json)
    ips+=("$(field images_per_second <<<"$out")")
    firsts+=("$(field first_batch_seconds <<<"$out")")
    fresh+=("$(field fresh_first_batch_seconds <<<"$out")")
  done
  m=$(printf '%s\n' "${ips[@]}" | median)
  f=$(printf '%s\n' "${firsts[@]}" | median)
  w=$(printf '%s\n' "${fresh[@]}" | median)
  printf 'forkguard %-7s workers=2: %7.1f img/s (after 1st batch, median)  first batch %.3f s (fresh loader on running cores %.3f s)  | runs: %s\n' \
    "$kind" "$m" "$f" "$w" "${ips[*]}"
  [ "$kind" = process ] && first_process=$f && fresh_process=$w
  best=$(awk -v a="$best" -v b="$m" 'BEGIN { print (b > a) ? b : a }')
done

decode=()
for run in 1 2 3; do
  decode+=("$("$fg" bench decode --data "$dir" --workers 2 --json | field images_per_second)")
done
ceiling=$(printf '%s\n' "${decode[@]}" | median)
printf 'libjpeg-turbo full-size decode only, 2 threads: %7.1f img/s (median) | runs: %s\n' "$ceiling" "${decode[*]}"

awk -v f="$best" -v t="$torch_ips" -v c="$ceiling" -v fb="$first_process" -v fw="$fresh_process" 'BEGIN {
  printf "forkguard %.1f img/s vs PyTorch DataLoader %.1f img/s: %.2fx\n", f, t, f / t
  printf "forkguard %.1f img/s vs decode-only ceiling %.1f img/s: %.2fx\n", f, c, f / c
  printf "forkguard first batch with 2 process workers: %.0f ms from idle cores, %.0f ms on running cores\n", fb * 1000, fw * 1000 }'
