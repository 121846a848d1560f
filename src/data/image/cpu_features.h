// What the CPU (and the kernel's saved state) lets the image kernels use.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

// 1 when AVX2 code may run here, as glibc's loader found at start-up.
int forkguard_cpu_has_avx2(void);

#ifdef __cplusplus
}
#endif
