#include "data/image/resample.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "data/image/cpu_features.h"
#define FORKGUARD_RESAMPLE_X86 1
#endif

namespace forkguard::data::image {
namespace {

// Weights in fixed point, as Pillow computes 8-bit images (its PRECISION_BITS is 22 with 32-bit
// sums of 8-bit pixels; 14 bits keep every sum in int32 here too, and every weight in int16, which
// is what the vector paths multiply with).
constexpr int kBits = 14;

struct Taps {
  std::vector<int> first;      // first input index, per output index
  std::vector<int> count;      // taps, per output index
  std::vector<int32_t> fixed;  // `stride` weights per output index, scaled by 2^kBits, rounded
  std::vector<int16_t> w16;  // the same as int16, `stride16` (a multiple of 4) per index, 0-padded
  int stride = 0;
  int stride16 = 0;
};

// Pillow's precompute_coeffs for the bilinear (triangle) filter.
Taps taps(double in0, double in1, int in_size, int out_size) {
  Taps t;
  const double scale = (in1 - in0) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = 1.0 * filterscale;
  t.stride = static_cast<int>(std::ceil(support)) * 2 + 1;
  t.stride16 = (t.stride + 3) / 4 * 4;
  t.first.resize(static_cast<size_t>(out_size));
  t.count.resize(static_cast<size_t>(out_size));
  t.fixed.assign(static_cast<size_t>(out_size) * t.stride, 0);
  t.w16.assign(static_cast<size_t>(out_size) * t.stride16, 0);
  std::vector<float> k(static_cast<size_t>(t.stride));
  const double ss = 1.0 / filterscale;
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = in0 + (xx + 0.5) * scale;
    int xmin = std::max(static_cast<int>(center - support + 0.5), 0);
    int xmax = std::min(static_cast<int>(center + support + 0.5), in_size) - xmin;
    xmax = std::min(xmax, t.stride);
    double ww = 0;
    std::fill(k.begin(), k.end(), 0.f);
    for (int x = 0; x < xmax; ++x) {
      double d = std::abs((x + xmin - center + 0.5) * ss);
      double w = d < 1.0 ? 1.0 - d : 0.0;
      k[static_cast<size_t>(x)] = static_cast<float>(w);
      ww += w;
    }
    if (ww != 0) {
      for (int x = 0; x < xmax; ++x) {
        k[static_cast<size_t>(x)] = static_cast<float>(k[static_cast<size_t>(x)] / ww);
      }
    }
    t.first[static_cast<size_t>(xx)] = xmin;
    t.count[static_cast<size_t>(xx)] = std::max(xmax, 0);
    for (int x = 0; x < t.stride; ++x) {
      // Weights are >= 0: adding one half and truncating rounds them as lround would.
      const auto v = static_cast<int32_t>(k[static_cast<size_t>(x)] * (1 << kBits) + 0.5f);
      t.fixed[static_cast<size_t>(xx) * t.stride + x] = v;
      t.w16[static_cast<size_t>(xx) * t.stride16 + x] = static_cast<int16_t>(v);
    }
  }
  return t;
}

inline uint8_t clip8(int32_t acc) {
  int32_t v = (acc + (1 << (kBits - 1))) >> kBits;
  return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// ------------------------------------------------------------------ portable passes
// One row of RGB: out_w outputs from the taps.
void horizontal_scalar(const uint8_t* in, const Taps& tx, int out_w, uint8_t* out) {
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

// One output row, bytes [begin, end): `n` input rows weighted by k.
void vertical_scalar(const uint8_t* const* rows, const int32_t* k, int n, size_t begin, size_t end,
                     uint8_t* out) {
  for (size_t j = begin; j < end; ++j) {
    int32_t acc = 0;
    for (int i = 0; i < n; ++i) acc += k[i] * rows[i][j];
    out[j] = clip8(acc);
  }
}

#ifdef FORKGUARD_RESAMPLE_X86
// ------------------------------------------------------------------ AVX2 passes
// The same integer arithmetic as the portable passes (int16 weights, int32 sums, the same
// rounding), so the output is bit-identical: pmaddwd multiplies two taps at a time.

// Pairs of taps' weights as the vector kernels multiply them: the int16 pair (w[j], w[j+1]) in
// each int32 lane. Horizontal: lanes 0-2 and 4-6 (r, g, b of two rows; lanes 3 and 7 zero).
struct alignas(32) WeightPair {
  int32_t v[8];
};

int32_t pair_of(const int16_t* w) {
  int32_t pair;
  std::memcpy(&pair, w, 4);
  return pair;
}

// One output pixel of four rows: per 128-bit lane of `a` row 0 (lane 0) and row 1 (lane 1), of
// `b` rows 2 and 3, the sums [r g b 0] as int32, rounded and shifted. One 16-byte load per row
// covers four taps: two shuffles spread taps (0, 1) and (2, 3) of RGB into int16 pairs
// [r0 r1 g0 g1 b0 b1 0 0] and pmaddwd with the weight pair [w0 w1] gives [r g b 0].
struct Rows4 {
  const uint8_t *r0, *r1, *r2, *r3;
};

__attribute__((target("avx2"), always_inline)) inline void pixel4_avx2(const Rows4& in, size_t off,
                                                                       int n, const __m256i* wv,
                                                                       __m256i& a, __m256i& b) {
  const __m256i taps01 = _mm256_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1,
                                          0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
  const __m256i taps23 =
      _mm256_setr_epi8(6, -1, 9, -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1, -1, -1, 6, -1, 9, -1, 7,
                       -1, 10, -1, 8, -1, 11, -1, -1, -1, -1, -1);
  a = _mm256_setzero_si256();
  b = _mm256_setzero_si256();
  for (int j = 0; j < n; j += 4, wv += 2) {
    const size_t o = off + 3 * static_cast<size_t>(j);
    const __m256i pa = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(in.r1 + o),
                                           reinterpret_cast<const __m128i*>(in.r0 + o));
    const __m256i pb = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(in.r3 + o),
                                           reinterpret_cast<const __m128i*>(in.r2 + o));
    const __m256i w01 = _mm256_load_si256(wv), w23 = _mm256_load_si256(wv + 1);
    a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_shuffle_epi8(pa, taps01), w01));
    b = _mm256_add_epi32(b, _mm256_madd_epi16(_mm256_shuffle_epi8(pb, taps01), w01));
    a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_shuffle_epi8(pa, taps23), w23));
    b = _mm256_add_epi32(b, _mm256_madd_epi16(_mm256_shuffle_epi8(pb, taps23), w23));
  }
  const __m256i round = _mm256_set1_epi32(1 << (kBits - 1));
  a = _mm256_srai_epi32(_mm256_add_epi32(a, round), kBits);
  b = _mm256_srai_epi32(_mm256_add_epi32(b, round), kBits);
}

// Four rows at a time, with the same taps (two rows per 256-bit register, one per 128-bit lane:
// the four sums of a pixel are independent chains), two pixels per step. `w` holds
// tx.stride16 / 2 WeightPairs per output pixel. Reads up to 16 bytes from the first byte of each
// group of four taps: the caller pads the rows for which that is past the end of the image.
// Writes 8 bytes per two pixels (the last 2 belong to the next pixel, written next): each output
// row needs two bytes more than its pixels.
__attribute__((target("avx2"))) void horizontal4_avx2(const uint8_t* const in[4], const Taps& tx,
                                                      const WeightPair* w, int out_w,
                                                      uint8_t* const out[4]) {
  // [r g b 0 r g b 0] of two pixels -> [r g b r g b], per 8 bytes of each lane.
  const __m256i compact = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                           0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
  const size_t pairs = static_cast<size_t>(tx.stride16) / 2;
  // Locals: the byte stores below may alias anything, so members would be reloaded per pixel.
  const int* const count = tx.count.data();
  const int* const first = tx.first.data();
  const Rows4 rows{in[0], in[1], in[2], in[3]};
  uint8_t *const out0 = out[0], *const out1 = out[1], *const out2 = out[2], *const out3 = out[3];
  const auto* const wv = reinterpret_cast<const __m256i*>(w);
  int x = 0;
  for (; x + 1 < out_w; x += 2) {
    const size_t xs = static_cast<size_t>(x);
    __m256i a0, b0, a1, b1;
    pixel4_avx2(rows, static_cast<size_t>(first[xs]) * 3, count[xs], wv + xs * pairs, a0, b0);
    pixel4_avx2(rows, static_cast<size_t>(first[xs + 1]) * 3, count[xs + 1], wv + (xs + 1) * pairs,
                a1, b1);
    // Lane 0: [row 0: pixel x, x+1 | row 2: x, x+1], lane 1 the same of rows 1 and 3.
    const __m256i u = _mm256_shuffle_epi8(
        _mm256_packus_epi16(_mm256_packs_epi32(a0, a1), _mm256_packs_epi32(b0, b1)), compact);
    const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out0 + 3 * xs), lo);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out1 + 3 * xs), hi);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out2 + 3 * xs), _mm_srli_si128(lo, 6));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out3 + 3 * xs), _mm_srli_si128(hi, 6));
  }
  if (x < out_w) {  // an odd last pixel
    const size_t xs = static_cast<size_t>(x);
    __m256i a, b;
    pixel4_avx2(rows, static_cast<size_t>(first[xs]) * 3, count[xs], wv + xs * pairs, a, b);
    const __m256i p = _mm256_packs_epi32(a, b);
    const __m256i u = _mm256_packus_epi16(p, p);  // lane 0: row 0, row 2; lane 1: rows 1, 3
    const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    const int32_t v0 = _mm_cvtsi128_si32(lo), v1 = _mm_cvtsi128_si32(hi);
    const int32_t v2 = _mm_extract_epi32(lo, 1), v3 = _mm_extract_epi32(hi, 1);
    std::memcpy(out0 + 3 * xs, &v0, 4);
    std::memcpy(out1 + 3 * xs, &v1, 4);
    std::memcpy(out2 + 3 * xs, &v2, 4);
    std::memcpy(out3 + 3 * xs, &v3, 4);
  }
}

// 16 rounded sums to 16 bytes. Within each 128-bit lane: lo holds elements 0-3 (8-11), hi 4-7
// (12-15); the packs restore the order, the permute gathers the two lanes' bytes.
__attribute__((target("avx2"))) inline __m128i vertical_finish(__m256i lo, __m256i hi) {
  const __m256i round = _mm256_set1_epi32(1 << (kBits - 1));
  lo = _mm256_srai_epi32(_mm256_add_epi32(lo, round), kBits);
  hi = _mm256_srai_epi32(_mm256_add_epi32(hi, round), kBits);
  const __m256i w16 = _mm256_packs_epi32(lo, hi);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi16(w16, w16), 0x08));
}

// One output row from n input rows, 32 bytes at a time: two rows interleaved per pmaddwd, the
// weight pairs `w` (all eight lanes) computed once per output row.
__attribute__((target("avx2"))) void vertical_avx2(const uint8_t* const* rows, const int32_t* k,
                                                   const WeightPair* w, int n, size_t len,
                                                   uint8_t* out) {
  const auto* wv = reinterpret_cast<const __m256i*>(w);

  size_t j = 0;
  for (; j + 32 <= len; j += 32) {
    __m256i lo0 = _mm256_setzero_si256(), hi0 = lo0, lo1 = lo0, hi1 = lo0;
    for (int i = 0; i < n; i += 2) {
      const uint8_t* r0 = rows[i] + j;
      const uint8_t* r1 = rows[i + 1 < n ? i + 1 : i] + j;  // an odd last row: weight 0
      const __m256i wi = _mm256_load_si256(wv + i / 2);
      const __m256i a0 =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0)));
      const __m256i b0 =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r1)));
      const __m256i a1 =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + 16)));
      const __m256i b1 =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + 16)));
      lo0 = _mm256_add_epi32(lo0, _mm256_madd_epi16(_mm256_unpacklo_epi16(a0, b0), wi));
      hi0 = _mm256_add_epi32(hi0, _mm256_madd_epi16(_mm256_unpackhi_epi16(a0, b0), wi));
      lo1 = _mm256_add_epi32(lo1, _mm256_madd_epi16(_mm256_unpacklo_epi16(a1, b1), wi));
      hi1 = _mm256_add_epi32(hi1, _mm256_madd_epi16(_mm256_unpackhi_epi16(a1, b1), wi));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), vertical_finish(lo0, hi0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j + 16), vertical_finish(lo1, hi1));
  }
  for (; j + 16 <= len; j += 16) {
    __m256i lo = _mm256_setzero_si256(), hi = lo;
    for (int i = 0; i < n; i += 2) {
      const __m256i wi = _mm256_load_si256(wv + i / 2);
      const __m256i a =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + j)));
      const __m256i b = _mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i + 1 < n ? i + 1 : i] + j)));
      lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), wi));
      hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), wi));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), vertical_finish(lo, hi));
  }
  vertical_scalar(rows, k, n, j, len, out);
}

bool have_avx2() {
  return forkguard_cpu_has_avx2() != 0;
}
#endif

}  // namespace

void resample(const uint8_t* src, int w, int h, const Box& box, int out_w, int out_h, uint8_t* dst,
              Kernel kernel) {
  const Taps tx = taps(box.x0, box.x1, w, out_w);
  const Taps ty = taps(box.y0, box.y1, h, out_h);
  const bool avx2 = kernel == Kernel::kAuto && resample_uses_avx2();
  // Only the rows the vertical pass reads go through the horizontal pass.
  const int row0 = ty.first.front();
  int row1 = row0;
  for (int y = 0; y < out_h; ++y) {
    row1 = std::max(row1, ty.first[static_cast<size_t>(y)] + ty.count[static_cast<size_t>(y)]);
  }
  const size_t row_bytes = static_cast<size_t>(w) * 3;
  const size_t row = static_cast<size_t>(out_w) * 3;
  const size_t mid_row = row + 2;  // the vector pass writes two bytes past each row
  thread_local Pixels mid;  // every byte the vertical pass reads is written first: not cleared
  mid.resize(static_cast<size_t>(row1 - row0) * mid_row + 16);
#ifdef FORKGUARD_RESAMPLE_X86
  if (avx2) {
    const uint8_t* end = src + row_bytes * static_cast<size_t>(h);
    // How far past a row's start the vector pass reads; rows for which that is past the end of
    // the image are copied into padded buffers first (the last row or two).
    size_t need = row_bytes;
    for (int x = 0; x < out_w; ++x) {
      const size_t xs = static_cast<size_t>(x);
      need = std::max(need, 3 * static_cast<size_t>(tx.first[xs] + tx.count[xs]) + 16);
    }
    thread_local Pixels padded;  // each copy's padding is cleared where it is made
    thread_local std::vector<uint8_t> scratch;
    scratch.resize(row + 16);
    padded.resize(4 * need);
    const size_t pairs = static_cast<size_t>(tx.stride16) / 2;
    thread_local std::vector<WeightPair> hw;
    hw.resize(static_cast<size_t>(out_w) * pairs);
    for (size_t i = 0; i < hw.size(); ++i) {
      const int32_t v = pair_of(&tx.w16[2 * i]);  // pairs are consecutive: stride16 is even
      hw[i] = WeightPair{{v, v, v, 0, v, v, v, 0}};
    }
    for (int y = row0; y < row1; y += 4) {
      const uint8_t* in[4];
      uint8_t* out[4];
      int pads = 0;
      for (int i = 0; i < 4; ++i) {
        const int yy = std::min(y + i, row1 - 1);  // past the end: the last row again, discarded
        in[i] = src + static_cast<size_t>(yy) * row_bytes;
        out[i] = y + i < row1 ? &mid[static_cast<size_t>(y + i - row0) * mid_row] : scratch.data();
        if (in[i] + need > end) {
          uint8_t* copy = padded.data() + static_cast<size_t>(pads++) * need;
          std::memset(copy + row_bytes, 0, need - row_bytes);
          std::memcpy(copy, in[i], row_bytes);
          in[i] = copy;
        }
      }
      horizontal4_avx2(in, tx, hw.data(), out_w, out);
    }
  }
#endif
  for (int y = row0; !avx2 && y < row1; ++y) {
    horizontal_scalar(src + static_cast<size_t>(y) * row_bytes, tx, out_w,
                      &mid[static_cast<size_t>(y - row0) * mid_row]);
  }
  std::vector<const uint8_t*> rows(static_cast<size_t>(ty.stride));
#ifdef FORKGUARD_RESAMPLE_X86
  const size_t vpairs = static_cast<size_t>(ty.stride16) / 2;
  thread_local std::vector<WeightPair> vw;
  if (avx2) {
    vw.resize(static_cast<size_t>(out_h) * vpairs);
    for (size_t i = 0; i < vw.size(); ++i) {
      const int32_t v = pair_of(&ty.w16[2 * i]);
      vw[i] = WeightPair{{v, v, v, v, v, v, v, v}};
    }
  }
#endif
  for (int y = 0; y < out_h; ++y) {
    const int32_t* k = &ty.fixed[static_cast<size_t>(y) * ty.stride];
    const int first = ty.first[static_cast<size_t>(y)];
    const int n = ty.count[static_cast<size_t>(y)];
    for (int i = 0; i < n; ++i) {
      rows[static_cast<size_t>(i)] = &mid[static_cast<size_t>(first + i - row0) * mid_row];
    }
    uint8_t* out = dst + static_cast<size_t>(y) * row;
#ifdef FORKGUARD_RESAMPLE_X86
    if (avx2) {
      vertical_avx2(rows.data(), k, &vw[static_cast<size_t>(y) * vpairs], n, row, out);
      continue;
    }
#endif
    vertical_scalar(rows.data(), k, n, 0, row, out);
  }
}

namespace {

void normalize_row_scalar(const uint8_t* rgb, int n, bool flip, const float scale[3],
                          const float bias[3], float* const planes[3], int from) {
  for (int x = from; x < n; ++x) {
    const uint8_t* p = rgb + 3 * static_cast<size_t>(flip ? n - 1 - x : x);
    for (int c = 0; c < 3; ++c) {
      const float v = static_cast<float>(p[c]) * scale[c];
      planes[c][x] = v + bias[c];
    }
  }
}

#ifdef FORKGUARD_RESAMPLE_X86
// 8 pixels at a time: two overlapping 16-byte loads hold pixels 0-3 and 4-7; per channel two
// shuffles gather its 8 bytes (in reverse order when flipping), widened to 8 floats.
__attribute__((target("avx2"))) int normalize_row_avx2(const uint8_t* rgb, int n, bool flip,
                                                       const float scale[3], const float bias[3],
                                                       float* const planes[3]) {
  __m128i lo_mask[3], hi_mask[3];
  for (int c = 0; c < 3; ++c) {
    alignas(16) int8_t lo[16], hi[16];
    std::memset(lo, -1, 16);
    std::memset(hi, -1, 16);
    for (int i = 0; i < 4; ++i) {
      const auto at = static_cast<int8_t>(c + 3 * i);
      if (flip) {
        lo[7 - i] = at;  // pixels 0-3 to positions 7-4
        hi[3 - i] = at;  // pixels 4-7 to positions 3-0
      } else {
        lo[i] = at;
        hi[4 + i] = at;
      }
    }
    lo_mask[c] = _mm_load_si128(reinterpret_cast<const __m128i*>(lo));
    hi_mask[c] = _mm_load_si128(reinterpret_cast<const __m128i*>(hi));
  }
  int x = 0;
  for (; x + 8 <= n; x += 8) {
    // Output positions x..x+7 come from input pixels x..x+7, or n-8-x..n-1-x when flipping.
    const uint8_t* p = rgb + 3 * static_cast<size_t>(flip ? n - 8 - x : x);
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 12));
    for (int c = 0; c < 3; ++c) {
      const __m128i bytes =
          _mm_or_si128(_mm_shuffle_epi8(lo, lo_mask[c]), _mm_shuffle_epi8(hi, hi_mask[c]));
      const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
      const __m256 v =
          _mm256_add_ps(_mm256_mul_ps(f, _mm256_set1_ps(scale[c])), _mm256_set1_ps(bias[c]));
      _mm256_storeu_ps(planes[c] + x, v);
    }
  }
  return x;
}
#endif

}  // namespace

void normalize_row(const uint8_t* rgb, int n, bool flip, const float scale[3], const float bias[3],
                   float* const planes[3], Kernel kernel) {
  int done = 0;
#ifdef FORKGUARD_RESAMPLE_X86
  if (kernel == Kernel::kAuto && resample_uses_avx2()) {
    done = normalize_row_avx2(rgb, n, flip, scale, bias, planes);
  }
#else
  (void)kernel;
#endif
  normalize_row_scalar(rgb, n, flip, scale, bias, planes, done);
}

bool resample_uses_avx2() {
#ifdef FORKGUARD_RESAMPLE_X86
  return have_avx2();
#else
  return false;
#endif
}

}  // namespace forkguard::data::image
