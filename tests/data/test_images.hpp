// Images made in the data tests: a smooth, colourful picture, its JPEG (libjpeg-turbo) or PNG
// (libpng), the bytes of a file, and the message of a DataError. One place, so every test encodes
// alike.
#pragma once

#include <gtest/gtest.h>
#include <jpeglib.h>
#include <png.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "forkguard/data/error.hpp"

namespace forkguard::testing {

// w x h RGB: horizontal and vertical gradients and a sine, shifted by `seed`.
inline std::vector<uint8_t> gradient_picture(int w, int h, int seed) {
  std::vector<uint8_t> rgb(static_cast<size_t>(w) * h * 3);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      uint8_t* p = &rgb[(static_cast<size_t>(y) * w + x) * 3];
      p[0] = static_cast<uint8_t>((x * 255) / w + seed * 17);
      p[1] = static_cast<uint8_t>((y * 255) / h);
      p[2] = static_cast<uint8_t>(128 + 100 * std::sin((x + seed) * 0.1));
    }
  }
  return rgb;
}

// `pixels` (RGB, or gray with comps = 1) as a baseline JPEG, 4:2:0 for RGB; `app1` is written as
// an APP1 marker when given (EXIF).
inline std::vector<unsigned char> encode_jpeg(const std::vector<uint8_t>& pixels, int w, int h,
                                              int quality = 90, int comps = 3,
                                              const std::vector<uint8_t>& app1 = {}) {
  jpeg_compress_struct c{};
  jpeg_error_mgr err{};
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  unsigned char* out = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &out, &size);
  c.image_width = static_cast<JDIMENSION>(w);
  c.image_height = static_cast<JDIMENSION>(h);
  c.input_components = comps;
  c.in_color_space = comps == 3 ? JCS_RGB : JCS_GRAYSCALE;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, quality, TRUE);
  jpeg_start_compress(&c, TRUE);
  if (!app1.empty()) {
    jpeg_write_marker(&c, JPEG_APP0 + 1, app1.data(), static_cast<unsigned>(app1.size()));
  }
  while (c.next_scanline < c.image_height) {
    auto* row = const_cast<JSAMPLE*>(&pixels[static_cast<size_t>(c.next_scanline) * w * comps]);
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  std::vector<unsigned char> bytes(out, out + size);
  jpeg_destroy_compress(&c);
  std::free(out);
  return bytes;
}

// `pixels` in libpng's `format` (PNG_FORMAT_RGB, _GA, ... | PNG_FORMAT_FLAG_LINEAR for 16 bits) as
// a PNG.
inline std::vector<uint8_t> encode_png(const void* pixels, int w, int h, uint32_t format) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(w);
  img.height = static_cast<png_uint_32>(h);
  img.format = format;
  png_alloc_size_t size = 0;
  EXPECT_NE(png_image_write_to_memory(&img, nullptr, &size, 0, pixels, 0, nullptr), 0);
  std::vector<uint8_t> out(size);
  EXPECT_NE(png_image_write_to_memory(&img, out.data(), &size, 0, pixels, 0, nullptr), 0);
  out.resize(size);
  return out;
}

// Writes `bytes` to `path`, creating its directory.
template <typename Bytes>
void write_bytes(const std::filesystem::path& path, const Bytes& bytes) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}

// The message of the DataError `f` throws, or "(no error)".
inline std::string data_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const forkguard::data::DataError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace forkguard::testing
