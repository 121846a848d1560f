#!/usr/bin/env bash
# The PyTorch DataLoader and forkguard's loader on the same files, same batch size (64), same
# number of workers (2 fork workers for PyTorch: its fastest configuration on 2 cores), the same
# pipeline (decode, RandomResizedCrop 224, flip, normalize, float32), in one run, and the ratio.
#   bench/compare_torch.sh DIR [BUILD]      (DIR: an ImageFolder, e.g. from ../shared/bench-data)
set -euo pipefail
dir=${1:?usage: bench/compare_torch.sh IMAGEFOLDER [BUILD]}
build=${2:-build/release}
here=$(cd "$(dirname "$0")" && pwd)
peer=$here/../../shared/bench-data/torch_loader_bench.py
[ -f "$peer" ] || peer=$here/../shared/bench-data/torch_loader_bench.py
workers=2
torch_out=$(/usr/bin/python3 "$peer" --root "$dir" --only 3 --runs 3)
echo "$torch_out"
torch_ips=$(sed -n 's/.*float32: *\([0-9.]*\) img\/s.*/\1/p' <<<"$torch_out" | head -1)
best=0
for kind in thread process; do
  for run in 1 2 3; do
    out=$("$build/bin/forkguard" bench loader --data "$dir" --workers $workers --worker-kind $kind --epochs 2 --json)
    ips=$(sed -n 's/.*"images_per_second":\([0-9.]*\).*/\1/p' <<<"$out")
    echo "forkguard $kind workers=$workers run $run: $ips img/s"
    best=$(awk -v a="$best" -v b="$ips" 'BEGIN { print (b > a) ? b : a }')
  done
done
awk -v f="$best" -v t="$torch_ips" 'BEGIN { printf "forkguard best %.1f img/s vs PyTorch DataLoader %.1f img/s: %.2fx\n", f, t, f / t }'
