// Antialiased bilinear resampling of a box of an 8-bit RGB image, computed as Pillow's
// Image.resize(size, BILINEAR, box) computes it: separable triangle filter whose support grows
// with the downscaling factor, horizontal pass first (rounded to 8 bits), then vertical.
#pragma once

#include <cstdint>
#include <vector>

#include "data/image/decode.hpp"

namespace forkguard::data::image {

enum class Kernel {
  kAuto,      // AVX2 where the CPU has it (checked once), else portable C++
  kPortable,  // portable C++ only (the vector kernels are held to it, bit for bit)
};

// Resamples `box` of the w x h RGB image `src` to out_w x out_h RGB into `dst`. Reentrant.
void resample(const uint8_t* src, int w, int h, const Box& box, int out_w, int out_h, uint8_t* dst,
              Kernel kernel = Kernel::kAuto);

// Whether Kernel::kAuto runs the AVX2 kernels on this CPU.
bool resample_uses_avx2();

// One row of n RGB pixels (readable 16 bytes past its end) to three float planes, mirrored when
// `flip`: plane c gets float(v) * scale[c] + bias[c] (a multiply, then an add, never fused, so
// every kernel computes the same floats).
void normalize_row(const uint8_t* rgb, int n, bool flip, const float scale[3], const float bias[3],
                   float* const planes[3], Kernel kernel = Kernel::kAuto);

}  // namespace forkguard::data::image
