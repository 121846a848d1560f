#!/bin/sh
# Every ELF file the build makes (programs, libraries, the Python module) has a RUNPATH/RPATH of
# absolute or $ORIGIN-relative directories only: an empty entry (a leading, trailing or doubled
# ':') or a relative one makes the dynamic loader search the current directory, so any
# libnvidia-ml.so.1 or libcuda.so.1 in the folder a user runs forkguard from would be loaded (and
# its constructor run).
# Usage: check_runpath.sh BUILD_DIR
set -u
build=$1
checked=0
bad=0
for f in $(find "$build/bin" "$build/lib" "$build/python" "$build/examples" "$build/bench" \
             -name CMakeFiles -prune -o -type f -print 2>/dev/null); do
  head -c 4 "$f" 2>/dev/null | grep -q 'ELF' || continue
  checked=$((checked + 1))
  paths=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(\(RUNPATH\|RPATH\)).*\[\(.*\)\]$/\2/p')
  for p in $paths; do
    case ":$p:" in
      *::*) echo "$f: empty entry in RUNPATH [$p] (the current directory)"; bad=$((bad + 1)) ;;
    esac
    old_ifs=$IFS
    IFS=:
    for entry in $p; do
      case "$entry" in
        /* | '$ORIGIN' | '$ORIGIN/'* | '${ORIGIN}' | '${ORIGIN}/'*) ;;
        '') ;;  # reported above
        *) echo "$f: relative entry '$entry' in RUNPATH [$p] (relative to the current directory)"
           bad=$((bad + 1)) ;;
      esac
    done
    IFS=$old_ifs
  done
done
if [ "$checked" -eq 0 ]; then
  echo "no ELF files under $build"
  exit 1
fi
echo "$checked ELF files checked, $bad bad RUNPATH entries"
[ "$bad" -eq 0 ]
