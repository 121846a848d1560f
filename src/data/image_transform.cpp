#include "forkguard/data/image_transform.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "data/image/decode.hpp"
#include "data/image/resample.hpp"
#include "forkguard/data/error.hpp"

namespace forkguard::data {
namespace {

uint16_t to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffffu;
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (inputs are finite)
  if (exp <= 0) {                                               // subnormal or zero
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    const uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1))) ++half;  // round to nearest even
  return static_cast<uint16_t>(sign | half);
}

}  // namespace

std::array<int, 4> random_resized_crop_box(int width, int height, const ImageOptions& o, Rng& rng) {
  const double area = static_cast<double>(width) * height;
  const double log_r0 = std::log(o.ratio_min), log_r1 = std::log(o.ratio_max);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * rng.uniform(o.scale_min, o.scale_max);
    const double aspect = std::exp(rng.uniform(log_r0, log_r1));
    const int w = static_cast<int>(std::lround(std::sqrt(target * aspect)));
    const int h = static_cast<int>(std::lround(std::sqrt(target / aspect)));
    if (0 < w && w <= width && 0 < h && h <= height) {
      const int y = static_cast<int>(rng.uniform_int(0, height - h));
      const int x = static_cast<int>(rng.uniform_int(0, width - w));
      return {x, y, w, h};
    }
  }
  // Fallback: the central crop, the aspect ratio clamped to the range.
  const double in_ratio = static_cast<double>(width) / height;
  int w = width, h = height;
  if (in_ratio < o.ratio_min) {
    h = static_cast<int>(std::lround(w / o.ratio_min));
  } else if (in_ratio > o.ratio_max) {
    w = static_cast<int>(std::lround(h * o.ratio_max));
  }
  return {(width - w) / 2, (height - h) / 2, w, h};
}

ImageTransform::ImageTransform(ImageOptions o) : options_(o) {
  if (o.size <= 0 || (!o.train && o.resize < o.size)) {
    throw DataError(
        fmt::format("ImageTransform: size {} / resize {} make no sense", o.size, o.resize));
  }
  if (o.dtype != DType::kFloat32 && o.dtype != DType::kFloat16 && o.dtype != DType::kUInt8) {
    throw DataError("ImageTransform: dtype must be float32, float16 or uint8");
  }
  if (o.layout == Layout::kNHWC && o.dtype != DType::kUInt8) {
    throw DataError("ImageTransform: NHWC is for uint8 output; float outputs are NCHW");
  }
  if (o.layout == Layout::kAny) options_.layout = Layout::kNCHW;
}

OutputSpec ImageTransform::output() const {
  const int64_t s = options_.size;
  if (options_.layout == Layout::kNHWC) return {{s, s, 3}, options_.dtype, Layout::kNHWC};
  return {{3, s, s}, options_.dtype, Layout::kNCHW};
}

void ImageTransform::apply(const Sample& in, std::span<std::byte> out, Rng& rng) const {
  const auto& o = options_;
  bool flip = false;
  image::DecodeOptions d{o.max_pixels, o.size, o.size, o.crop_aware};
  auto region = image::decode(in.data.data(), in.data.size(), in.key, d, [&](int w, int h) {
    if (o.train) {
      auto [x, y, cw, ch] = random_resized_crop_box(w, h, o, rng);
      flip = rng.bernoulli(o.flip);
      return image::Box{static_cast<double>(x), static_cast<double>(y), static_cast<double>(x + cw),
                        static_cast<double>(y + ch)};
    }
    // Resize(shorter side = resize), then CenterCrop(size): the box of the original that the
    // center crop of the resized image covers (Pillow resamples a box exactly so).
    const double s = static_cast<double>(o.resize) / std::min(w, h);
    const int rw = w <= h ? o.resize : static_cast<int>(o.resize * static_cast<double>(w) / h);
    const int rh = h <= w ? o.resize : static_cast<int>(o.resize * static_cast<double>(h) / w);
    const double left = std::round((rw - o.size) / 2.0), top = std::round((rh - o.size) / 2.0);
    const double sx = static_cast<double>(rw) / w, sy = static_cast<double>(rh) / h;
    (void)s;
    return image::Box{left / sx, top / sy, (left + o.size) / sx, (top + o.size) / sy};
  });
  const int n = o.size;
  thread_local std::vector<uint8_t> rgb;
  rgb.resize(static_cast<size_t>(n) * n * 3 + 16);  // normalize_row reads past a row's end
  image::resample(region.rgb.data(), region.width, region.height, region.box, n, n, rgb.data());
  const size_t plane = static_cast<size_t>(n) * n;
  // Row by row; a flip reads the row backwards.
  if (o.dtype == DType::kUInt8) {
    auto* dst = reinterpret_cast<uint8_t*>(out.data());
    for (int y = 0; y < n; ++y) {
      const uint8_t* row = &rgb[static_cast<size_t>(y) * n * 3];
      for (int x = 0; x < n; ++x) {
        const uint8_t* p = row + 3 * static_cast<size_t>(flip ? n - 1 - x : x);
        const size_t i = static_cast<size_t>(y) * n + static_cast<size_t>(x);
        if (o.layout == Layout::kNHWC) {
          dst[3 * i] = p[0], dst[3 * i + 1] = p[1], dst[3 * i + 2] = p[2];
        } else {
          dst[i] = p[0], dst[plane + i] = p[1], dst[2 * plane + i] = p[2];
        }
      }
    }
    return;
  }
  // Normalize((v / 255 - mean) / std) as one multiply and one add per value (within an ulp of
  // torchvision's ToTensor + Normalize).
  float scale[3], bias[3];
  for (size_t c = 0; c < 3; ++c) {
    scale[c] = static_cast<float>(1.0 / (255.0 * static_cast<double>(o.std[c])));
    bias[c] = static_cast<float>(-static_cast<double>(o.mean[c]) / static_cast<double>(o.std[c]));
  }
  if (o.dtype == DType::kFloat32) {
    auto* dst = reinterpret_cast<float*>(out.data());
    for (int y = 0; y < n; ++y) {
      float* d0 = dst + static_cast<size_t>(y) * n;
      float* const planes[3] = {d0, d0 + plane, d0 + 2 * plane};
      image::normalize_row(&rgb[static_cast<size_t>(y) * n * 3], n, flip, scale, bias, planes);
    }
    return;
  }
  // float16: a per-channel table of the 256 values, the same floats as float32 rounded to half.
  uint16_t half[3][256];
  for (int c = 0; c < 3; ++c) {
    for (int v = 0; v < 256; ++v) {
      const float x = static_cast<float>(v) * scale[c];
      half[c][v] = to_half(x + bias[c]);
    }
  }
  auto* dst = reinterpret_cast<uint16_t*>(out.data());
  for (int y = 0; y < n; ++y) {
    const uint8_t* row = &rgb[static_cast<size_t>(y) * n * 3];
    uint16_t* d0 = dst + static_cast<size_t>(y) * n;
    for (int x = 0; x < n; ++x) {
      const uint8_t* p = row + 3 * static_cast<size_t>(flip ? n - 1 - x : x);
      d0[x] = half[0][p[0]];
      d0[plane + static_cast<size_t>(x)] = half[1][p[1]];
      d0[2 * plane + static_cast<size_t>(x)] = half[2][p[2]];
    }
  }
}

std::optional<Description> ImageTransform::describe() const {
  const auto& o = options_;
  return Description{"image",
                     {{"train", o.train},
                      {"size", o.size},
                      {"scale", {o.scale_min, o.scale_max}},
                      {"ratio", {o.ratio_min, o.ratio_max}},
                      {"flip", o.flip},
                      {"resize", o.resize},
                      {"mean", o.mean},
                      {"std", o.std},
                      {"dtype", static_cast<int>(o.dtype)},
                      {"layout", static_cast<int>(o.layout)},
                      {"max_pixels", o.max_pixels},
                      {"crop_aware", o.crop_aware}}};
}

FORKGUARD_REGISTER_TRANSFORM(image, [](const nlohmann::json& p) {
  ImageOptions o;
  o.train = p.at("train");
  o.size = p.at("size");
  o.scale_min = p.at("scale")[0];
  o.scale_max = p.at("scale")[1];
  o.ratio_min = p.at("ratio")[0];
  o.ratio_max = p.at("ratio")[1];
  o.flip = p.at("flip");
  o.resize = p.at("resize");
  o.mean = p.at("mean");
  o.std = p.at("std");
  o.dtype = static_cast<DType>(p.at("dtype").get<int>());
  o.layout = static_cast<Layout>(p.at("layout").get<int>());
  o.max_pixels = p.at("max_pixels");
  o.crop_aware = p.at("crop_aware");
  return std::make_unique<ImageTransform>(o);
});

}  // namespace forkguard::data
