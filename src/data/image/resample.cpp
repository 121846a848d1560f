#include "data/image/resample.hpp"

#include <algorithm>
#include <cmath>

namespace forkguard::data::image {
namespace {

// Weights in fixed point, as Pillow computes 8-bit images (its PRECISION_BITS is 22 with 32-bit
// sums of 8-bit pixels; 14 bits keep every sum in int32 here too).
constexpr int kBits = 14;

struct Taps {
  std::vector<int> first;      // first input index, per output index
  std::vector<int> count;      // taps, per output index
  std::vector<float> weight;   // `stride` weights per output index
  std::vector<int32_t> fixed;  // the same, scaled by 2^kBits and rounded
  int stride = 0;
};

// Pillow's precompute_coeffs for the bilinear (triangle) filter.
Taps taps(double in0, double in1, int in_size, int out_size) {
  Taps t;
  const double scale = (in1 - in0) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = 1.0 * filterscale;
  t.stride = static_cast<int>(std::ceil(support)) * 2 + 1;
  t.first.resize(static_cast<size_t>(out_size));
  t.count.resize(static_cast<size_t>(out_size));
  t.weight.assign(static_cast<size_t>(out_size) * t.stride, 0.f);
  const double ss = 1.0 / filterscale;
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = in0 + (xx + 0.5) * scale;
    int xmin = std::max(static_cast<int>(center - support + 0.5), 0);
    int xmax = std::min(static_cast<int>(center + support + 0.5), in_size) - xmin;
    xmax = std::min(xmax, t.stride);
    double ww = 0;
    float* k = &t.weight[static_cast<size_t>(xx) * t.stride];
    for (int x = 0; x < xmax; ++x) {
      double d = std::abs((x + xmin - center + 0.5) * ss);
      double w = d < 1.0 ? 1.0 - d : 0.0;
      k[x] = static_cast<float>(w);
      ww += w;
    }
    if (ww != 0) {
      for (int x = 0; x < xmax; ++x) k[x] = static_cast<float>(k[x] / ww);
    }
    t.first[static_cast<size_t>(xx)] = xmin;
    t.count[static_cast<size_t>(xx)] = std::max(xmax, 0);
  }
  t.fixed.resize(t.weight.size());
  for (size_t i = 0; i < t.weight.size(); ++i) {
    t.fixed[i] = static_cast<int32_t>(std::lround(t.weight[i] * (1 << kBits)));
  }
  return t;
}

inline uint8_t clip8(int32_t acc) {
  int32_t v = (acc + (1 << (kBits - 1))) >> kBits;
  return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

}  // namespace

void resample(const uint8_t* src, int w, int h, const Box& box, int out_w, int out_h,
              uint8_t* dst) {
  const Taps tx = taps(box.x0, box.x1, w, out_w);
  const Taps ty = taps(box.y0, box.y1, h, out_h);
  // Only the rows the vertical pass reads go through the horizontal pass.
  const int row0 = ty.first.front();
  int row1 = row0;
  for (int y = 0; y < out_h; ++y) {
    row1 = std::max(row1, ty.first[static_cast<size_t>(y)] + ty.count[static_cast<size_t>(y)]);
  }
  std::vector<uint8_t> mid(static_cast<size_t>(row1 - row0) * out_w * 3);
  for (int y = row0; y < row1; ++y) {
    const uint8_t* in = src + static_cast<size_t>(y) * w * 3;
    uint8_t* out = &mid[static_cast<size_t>(y - row0) * out_w * 3];
    for (int x = 0; x < out_w; ++x) {
      const int32_t* k = &tx.fixed[static_cast<size_t>(x) * tx.stride];
      const uint8_t* p = in + static_cast<size_t>(tx.first[static_cast<size_t>(x)]) * 3;
      int32_t r = 0, g = 0, b = 0;
      for (int i = 0, n = tx.count[static_cast<size_t>(x)]; i < n; ++i) {
        r += k[i] * p[3 * i];
        g += k[i] * p[3 * i + 1];
        b += k[i] * p[3 * i + 2];
      }
      out[3 * x] = clip8(r);
      out[3 * x + 1] = clip8(g);
      out[3 * x + 2] = clip8(b);
    }
  }
  const size_t row = static_cast<size_t>(out_w) * 3;
  std::vector<int32_t> acc(row);
  for (int y = 0; y < out_h; ++y) {
    std::fill(acc.begin(), acc.end(), 0);
    const int32_t* k = &ty.fixed[static_cast<size_t>(y) * ty.stride];
    const int first = ty.first[static_cast<size_t>(y)];
    for (int i = 0, n = ty.count[static_cast<size_t>(y)]; i < n; ++i) {
      const uint8_t* in = &mid[static_cast<size_t>(first + i - row0) * row];
      const int32_t wgt = k[i];
      int32_t* a = acc.data();
      for (size_t j = 0; j < row; ++j) a[j] += wgt * in[j];
    }
    uint8_t* out = dst + static_cast<size_t>(y) * row;
    for (size_t j = 0; j < row; ++j) out[j] = clip8(acc[j]);
  }
}

}  // namespace forkguard::data::image
