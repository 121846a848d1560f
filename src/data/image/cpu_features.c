/* The answer of glibc's loader, which examined the CPU once at start-up (<sys/platform/x86.h>,
   glibc 2.33). Written in C because that header is C: clang will not read its _Bool in C++. Not
   __builtin_cpu_supports: that links libgcc's cpu-model constructor, which runs CPUID again at
   the start of every process (each one a trap to the hypervisor in a VM: 0.15 ms of every
   forkguard run, docs/performance.md). */
#include "data/image/cpu_features.h"

#if defined(__x86_64__) || defined(__i386__)
#include <sys/platform/x86.h>

int forkguard_cpu_has_avx2(void) {
  return CPU_FEATURE_ACTIVE(AVX2);
}
#else
int forkguard_cpu_has_avx2(void) {
  return 0;
}
#endif
