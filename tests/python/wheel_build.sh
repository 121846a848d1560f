#!/usr/bin/env bash
# Builds forkguard as a pip user gets it, for tests/python/test_wheel.py: the sdist of the source
# tree (python -m build --sdist), the wheel from that sdist (pip wheel: pyproject.toml's
# scikit-build-core driving the project's CMake, so the sdist is proven complete by the same
# compile), then auditwheel's report of the wheel and the wheel repaired to the policy it names.
# The tools are build/wheel-tools' (scripts/install-deps), pinned; nothing is downloaded.
#
#   wheel_build.sh SOURCE_DIR TOOLS_VENV OUT_DIR
#
# OUT_DIR gets forkguard-VERSION.tar.gz, dist/ (the wheel as built), auditwheel-show.txt and
# repaired/ (the wheel a user installs).
set -euo pipefail
src=$1
tools=$2
out=$3
py=$tools/bin/python
if [ ! -x "$py" ]; then
  echo "no wheel tools at $tools: run scripts/install-deps" >&2
  exit 1
fi
rm -rf "$out"
mkdir -p "$out/dist" "$out/repaired"
start=$SECONDS
"$py" -m build --sdist --no-isolation --outdir "$out" "$src" >"$out/sdist.log" 2>&1 ||
  { cat "$out/sdist.log"; exit 1; }
sdist=$(ls "$out"/forkguard-*.tar.gz)
echo "sdist: $(basename "$sdist"), $(stat -c %s "$sdist") bytes ($((SECONDS - start)) s)"
# The compile is the one long step: both cores, as pip would use them.
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
"$py" -m pip wheel --no-build-isolation --no-deps --disable-pip-version-check -v \
  --wheel-dir "$out/dist" "$sdist" >"$out/wheel.log" 2>&1 || { tail -60 "$out/wheel.log"; exit 1; }
wheel=$(ls "$out"/dist/forkguard-*.whl)
echo "wheel: $(basename "$wheel"), $(stat -c %s "$wheel") bytes ($((SECONDS - start)) s)"
PATH=$tools/bin:$PATH "$tools/bin/auditwheel" show "$wheel" | tee "$out/auditwheel-show.txt"
PATH=$tools/bin:$PATH "$tools/bin/auditwheel" repair --wheel-dir "$out/repaired" "$wheel" \
  >"$out/repair.log" 2>&1 || { cat "$out/repair.log"; exit 1; }
repaired=$(ls "$out"/repaired/forkguard-*.whl)
echo "repaired: $(basename "$repaired"), $(stat -c %s "$repaired") bytes"
