// Image decoding for the loader: JPEG with libjpeg-turbo (only the rows and columns a crop
// needs, at the largest DCT scale-down that keeps the crop at least the output size) and PNG with
// libpng (any bit depth, palette, gray, alpha -> 8-bit RGB). Every error names the path.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace forkguard::data::image {

struct Box {  // in pixels of the full-size image: [x0, x1) x [y0, y1)
  double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
  double width() const { return x1 - x0; }
  double height() const { return y1 - y0; }
};

// Bytes that are not zeroed when sized (the decoder overwrites every one): a vector's resize()
// would clear a few hundred kilobytes per image for nothing.
class Pixels {
 public:
  void resize(size_t n) {
    if (n > capacity_) {
      data_.reset(new uint8_t[n]);
      capacity_ = n;
    }
    size_ = n;
  }
  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  size_t size() const { return size_; }
  uint8_t& operator[](size_t i) { return data_[i]; }
  const uint8_t& operator[](size_t i) const { return data_[i]; }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

// The decoded pixels around a box: 8-bit RGB, `width` x `height`, and the box in those pixels'
// coordinates (scaled by 1/scale_denom, offset by the region's origin).
struct Region {
  Pixels rgb;
  int width = 0;
  int height = 0;
  Box box;
  int scale_denom = 1;
};

struct DecodeOptions {
  uint64_t max_pixels = 100'000'000;  // a header claiming more is refused before any allocation
  int out_width = 224;                // the size the box is resampled to: bounds the DCT scaling
  int out_height = 224;
  bool crop_aware = true;  // false: decode every pixel at full size (the ceiling)
};

// Decodes what `choose_box(width, height)` needs (it gets the full size from the header).
// `name` names the sample in errors. Throws DataError.
Region decode(const uint8_t* data, size_t size, const std::string& name, const DecodeOptions& o,
              const std::function<Box(int width, int height)>& choose_box);

}  // namespace forkguard::data::image
