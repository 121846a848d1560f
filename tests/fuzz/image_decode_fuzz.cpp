// The image decoder in front of libjpeg-turbo and libpng, with a small max_pixels (1 Mpixel):
// any bytes give pixels or a DataError, never a crash and never an allocation a header's claimed
// size drives past max_pixels (scripts/fuzz runs it under -rss_limit_mb=2048). The crop box and
// the output size vary with the input's last bytes, so that the crop-aware paths (DCT scaling,
// jpeg_crop_scanline, jpeg_skip_scanlines) run too.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "data/image/decode.hpp"
#include "forkguard/data/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace forkguard::data::image;
  if (size < 4) return 0;
  const uint8_t a = data[size - 1], b = data[size - 2], c = data[size - 3];
  const DecodeOptions o{.max_pixels = 1 << 20,
                        .out_width = 1 + a % 64,
                        .out_height = 1 + b % 64,
                        .crop_aware = (c & 1) == 0};
  // A box inside the image, as the transforms choose it: a fraction of each side, at an offset.
  auto choose = [&](int w, int h) {
    const double fx = (1 + c % 8) / 8.0, fy = (1 + (c >> 3) % 8) / 8.0;
    const double x0 = (w - w * fx) * (a % 5) / 4.0, y0 = (h - h * fy) * (b % 5) / 4.0;
    return Box{x0, y0, x0 + w * fx, y0 + h * fy};
  };
  try {
    const Region r = decode(data, size, "fuzz", o, choose);
    if (r.width <= 0 || r.height <= 0 ||
        r.rgb.size() != static_cast<size_t>(r.width) * static_cast<size_t>(r.height) * 3) {
      std::abort();
    }
  } catch (const forkguard::Error&) {
  }
  return 0;
}
