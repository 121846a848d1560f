#!/usr/bin/env bash
# Installs the build into a temporary prefix, then builds and runs a consumer twice: with
# find_package(forkguard) and with pkg-config.
set -euo pipefail
build=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
for f in bin/forkguard bin/forkguard-bench lib/libforkguard.so lib/libforkguard.a include/forkguard/probe/cuda_state.hpp \
         lib/cmake/forkguard/forkguardConfig.cmake lib/pkgconfig/forkguard.pc; do
  [ -e "$tmp/prefix/$f" ] || { echo "not installed: $f"; exit 1; }
done
[ -e "$tmp/prefix/lib/fake_cuda" ] && { echo "the test driver must never be installed"; exit 1; }
cmake -S "$src/consumer" -B "$tmp/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/consumer" >/dev/null
out=$("$tmp/consumer/consumer")
echo "find_package consumer: $out"
[ "$out" = "verdict clean" ] || exit 1
out=$("$tmp/consumer/consumer_static")
echo "static consumer: $out"
[ "$out" = "verdict clean" ] || exit 1
export PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig"
g++ "$src/consumer/main.cpp" $(pkg-config --cflags --libs forkguard) -Wl,-rpath,"$tmp/prefix/lib" -o "$tmp/pc_consumer"
out=$("$tmp/pc_consumer")
echo "pkg-config consumer: $out"
[ "$out" = "verdict clean" ]
"$tmp/prefix/bin/forkguard" --version
# `forkguard bench` runs the forkguard-bench installed beside it.
out=$("$tmp/prefix/bin/forkguard" bench --help)
[[ $out == *"Usage: forkguard bench"* ]] || { echo "forkguard bench --help: $out"; exit 1; }
