// The image pipeline's decode and transforms, on images made here with libjpeg and libpng.
#include <gtest/gtest.h>
#include <png.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include <jpeglib.h>

#include "data/image/decode.hpp"
#include "data/image/resample.hpp"
#include "forkguard/data/error.hpp"
#include "forkguard/data/image_transform.hpp"
#include "test_images.hpp"

namespace fd = forkguard::data;
namespace fi = forkguard::data::image;
namespace ft = forkguard::testing;

namespace {

// A smooth, colourful test picture: gradients plus a few sine waves.
std::vector<uint8_t> picture(int w, int h) {
  std::vector<uint8_t> rgb(static_cast<size_t>(w) * h * 3);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      uint8_t* p = &rgb[(static_cast<size_t>(y) * w + x) * 3];
      p[0] = static_cast<uint8_t>(255.0 * x / (w - 1));
      p[1] = static_cast<uint8_t>(255.0 * y / (h - 1));
      p[2] = static_cast<uint8_t>(127.5 + 127.0 * std::sin(x * 0.05) * std::cos(y * 0.07));
    }
  }
  return rgb;
}

fi::Region decode(const std::vector<uint8_t>& bytes, fi::Box box, int out, bool crop_aware = true,
                  uint64_t max_pixels = 100'000'000) {
  return fi::decode(bytes.data(), bytes.size(), "test.jpg", {max_pixels, out, out, crop_aware},
                    [&](int, int) { return box; });
}

std::vector<uint8_t> resampled(const fi::Region& r, int out) {
  std::vector<uint8_t> dst(static_cast<size_t>(out) * out * 3);
  fi::resample(r.rgb.data(), r.width, r.height, r.box, out, out, dst.data());
  return dst;
}

double mean_abs_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += std::abs(int(a[i]) - int(b[i]));
  return s / static_cast<double>(a.size());
}

}  // namespace

TEST(ImageDecode, CropAwareScaledDecodeMatchesTheFullDecodeOfTheSameBox) {
  const int w = 1200, h = 900;
  auto jpg = ft::encode_jpeg(picture(w, h), w, h, 95);
  for (fi::Box box : {fi::Box{100, 50, 1100, 850}, fi::Box{0, 0, 1200, 900},
                      fi::Box{700, 400, 1000, 700}, fi::Box{10.5, 20.25, 300.75, 500.5}}) {
    auto full = decode(jpg, box, 224, false);
    EXPECT_EQ(full.scale_denom, 1);
    EXPECT_EQ(full.width, w);
    auto crop = decode(jpg, box, 224, true);
    EXPECT_LT(crop.width * crop.height, w * h);  // fewer pixels decoded
    double diff = mean_abs_diff(resampled(full, 224), resampled(crop, 224));
    EXPECT_LT(diff, 2.0) << "box " << box.x0 << "," << box.y0 << " denom " << crop.scale_denom;
  }
  EXPECT_EQ(decode(jpg, {0, 0, 1200, 900}, 224).scale_denom, 4);  // 900/4 >= 224
  EXPECT_EQ(decode(jpg, {0, 0, 500, 500}, 224).scale_denom, 2);
  EXPECT_EQ(decode(jpg, {0, 0, 300, 300}, 224).scale_denom, 1);
}

TEST(ImageResample, VectorKernelsAreBitIdenticalToThePortableOnes) {
  if (!fi::resample_uses_avx2()) GTEST_SKIP() << "this CPU has no AVX2: only the portable kernels";
  // Odd sizes, boxes at every edge, down- and upscaling, tiny images (the last rows are padded).
  struct Case {
    int w, h;
    fi::Box box;
    int out;
  };
  for (const Case& c :
       {Case{640, 480, {0, 0, 640, 480}, 224}, Case{641, 479, {3.5, 7.25, 640, 479}, 224},
        Case{333, 222, {100, 50, 180, 130}, 224}, Case{5, 3, {0, 0, 5, 3}, 224},
        Case{4000, 30, {0, 0, 4000, 30}, 31}, Case{224, 224, {0, 0, 224, 224}, 224},
        Case{97, 1013, {1, 900, 96, 1013}, 17}}) {
    auto src = picture(c.w, c.h);
    std::vector<uint8_t> fast(static_cast<size_t>(c.out) * c.out * 3), slow(fast.size());
    fi::resample(src.data(), c.w, c.h, c.box, c.out, c.out, fast.data(), fi::Kernel::kAuto);
    fi::resample(src.data(), c.w, c.h, c.box, c.out, c.out, slow.data(), fi::Kernel::kPortable);
    EXPECT_EQ(fast, slow) << c.w << "x" << c.h << " -> " << c.out;
  }
}

TEST(ImageResample, VectorNormalizeIsBitIdenticalAndMirrors) {
  const float scale[3] = {1 / (255 * 0.229f), 1 / (255 * 0.224f), 1 / (255 * 0.225f)};
  const float bias[3] = {-0.485f / 0.229f, -0.456f / 0.224f, -0.406f / 0.225f};
  for (int n : {224, 13, 8, 1}) {
    auto row = picture(n, 1);
    row.resize(row.size() + 16);
    for (bool flip : {false, true}) {
      std::vector<float> fast(3 * static_cast<size_t>(n)), slow(fast.size());
      float* const pf[3] = {fast.data(), fast.data() + n, fast.data() + 2 * n};
      float* const ps[3] = {slow.data(), slow.data() + n, slow.data() + 2 * n};
      fi::normalize_row(row.data(), n, flip, scale, bias, pf, fi::Kernel::kAuto);
      fi::normalize_row(row.data(), n, flip, scale, bias, ps, fi::Kernel::kPortable);
      EXPECT_EQ(fast, slow) << n << (flip ? " flipped" : "");
      const int x = n / 3, src = flip ? n - 1 - x : x;
      EXPECT_NEAR(fast[static_cast<size_t>(n) + x], (row[3 * src + 1] / 255.0 - 0.456) / 0.224,
                  1e-5);
    }
  }
}

// EXIF orientation is ignored, as torchvision's ImageFolder (Pillow's open + convert) ignores it:
// a photo tagged "rotate 90" gives the same pixels, in the same shape, as the untagged one.
TEST(ImageDecode, ExifOrientationIsIgnoredAsTorchvisionDoes) {
  const int w = 400, h = 300;
  const std::vector<uint8_t> exif = {'E',  'x',  'i', 'f',  0, 0,        // APP1 Exif
                                     'M',  'M',  0,   0x2A, 0, 0, 0, 8,  // TIFF header
                                     0,    1,                            // one entry
                                     0x01, 0x12, 0,   3,    0, 0, 0, 1,
                                     0,    6,    0,   0,  // Orientation 6
                                     0,    0,    0,   0};
  auto plain = ft::encode_jpeg(picture(w, h), w, h, 95);
  auto tagged = ft::encode_jpeg(picture(w, h), w, h, 95, 3, exif);
  ASSERT_NE(plain, tagged);
  ASSERT_NE(std::search(tagged.begin(), tagged.end(), exif.begin(), exif.begin() + 4),
            tagged.end());
  for (bool train : {false, true}) {
    fd::ImageTransform t({.train = train, .dtype = fd::DType::kUInt8, .layout = fd::Layout::kNHWC});
    std::vector<std::byte> a(t.output().bytes()), b(a.size());
    fd::Rng r1(9, 0, 4), r2(9, 0, 4);
    t.apply({plain, 0, "plain.jpg"}, a, r1);
    t.apply({tagged, 0, "tagged.jpg"}, b, r2);
    EXPECT_EQ(a, b) << (train ? "train" : "eval");
  }
  auto full = decode(tagged, {0, 0, 400, 300}, 224, false);
  EXPECT_EQ(full.width, w);  // not turned into 300 x 400
  EXPECT_EQ(full.height, h);
}

TEST(ImageDecode, GrayJpegAndPngFormatsBecomeRgb) {
  const int w = 64, h = 48;
  std::vector<uint8_t> gray(static_cast<size_t>(w) * h);
  for (size_t i = 0; i < gray.size(); ++i) gray[i] = static_cast<uint8_t>(i % 251);
  auto g = decode(ft::encode_jpeg(gray, w, h, 95, 1), {0, 0, 64, 48}, 64, false);
  ASSERT_EQ(g.rgb.size(), static_cast<size_t>(w) * h * 3);
  EXPECT_EQ(g.rgb[300], g.rgb[301]);  // R == G == B
  EXPECT_NEAR(g.rgb[300], gray[100], 6);
  // PNG: 8-bit gray+alpha, RGBA (alpha dropped, not composited), 16-bit RGB.
  std::vector<uint8_t> ga(static_cast<size_t>(w) * h * 2, 0);
  for (size_t i = 0; i < ga.size(); i += 2) ga[i] = 77;  // alpha 0: still 77, as Pillow keeps it
  const auto ga_png = ft::encode_png(ga.data(), w, h, PNG_FORMAT_GA);
  auto r = fi::decode(ga_png.data(), ga_png.size(), "ga.png", {}, [](int, int) {
    return fi::Box{0, 0, 64, 48};
  });
  EXPECT_EQ(r.rgb[0], 77);
  EXPECT_EQ(r.rgb[1], 77);
  std::vector<uint16_t> deep(static_cast<size_t>(w) * h * 3, 0xffff);
  auto bytes = ft::encode_png(deep.data(), w, h, PNG_FORMAT_RGB | PNG_FORMAT_FLAG_LINEAR);
  auto d = fi::decode(bytes.data(), bytes.size(), "deep.png", {}, [](int, int) {
    return fi::Box{0, 0, 64, 48};
  });
  EXPECT_EQ(d.rgb[5], 255);
}

TEST(ImageDecode, BadInputIsNamedAndBombsAreRefusedBeforeDecoding) {
  auto jpg = ft::encode_jpeg(picture(320, 240), 320, 240, 95);
  EXPECT_EQ(ft::data_error_of([&] {
              decode({}, {0, 0, 1, 1}, 8);
            }),
            "test.jpg: empty file (0 bytes)");
  std::vector<uint8_t> text = {'h', 'e', 'l', 'l', 'o'};
  EXPECT_EQ(ft::data_error_of([&] {
              decode(text, {0, 0, 1, 1}, 8);
            }),
            "test.jpg: not an image (neither JPEG nor PNG)");
  std::vector<uint8_t> cut(jpg.begin(), jpg.begin() + static_cast<long>(jpg.size() / 2));
  EXPECT_EQ(ft::data_error_of([&] {
              decode(cut, {0, 0, 320, 240}, 64, false);
            }),
            "test.jpg: corrupt JPEG: truncated JPEG (premature end of data)");
  std::vector<uint8_t> garbage = jpg;
  for (size_t i = 4; i < 200; ++i) garbage[i] = 0x5a;  // the SOI and a marker byte kept
  EXPECT_NE(ft::data_error_of([&] {
              decode(garbage, {0, 0, 320, 240}, 64);
            }).find("test.jpg: corrupt JPEG: "),
            std::string::npos);
  // A header claiming 60000 x 60000: refused from the header, nothing allocated.
  std::vector<uint8_t> bomb = jpg;
  for (size_t i = 0; i + 8 < bomb.size(); ++i) {
    if (bomb[i] == 0xFF && (bomb[i + 1] == 0xC0 || bomb[i + 1] == 0xC2)) {
      bomb[i + 5] = 0xEA, bomb[i + 6] = 0x60, bomb[i + 7] = 0xEA, bomb[i + 8] = 0x60;
      break;
    }
  }
  EXPECT_EQ(ft::data_error_of([&] {
              decode(bomb, {0, 0, 1, 1}, 8);
            }),
            "test.jpg: 60000x60000 = 3600000000 pixels, more than max_pixels (100000000); "
            "refusing to decode (a decompression bomb?)");
  auto png = ft::encode_png(picture(32, 32).data(), 32, 32, PNG_FORMAT_RGB);
  png[40] ^= 0xff;  // inside IDAT: a bad checksum or bad data
  EXPECT_NE(ft::data_error_of([&] {
              fi::decode(png.data(), png.size(), "x.png", {}, [](int, int) {
                return fi::Box{0, 0, 32, 32};
              });
            }).find("x.png: corrupt PNG"),
            std::string::npos);
}

TEST(ImageTransform, RandomResizedCropFollowsTorchvision) {
  fd::ImageOptions o;
  int fallbacks = 0;
  for (uint64_t i = 0; i < 2000; ++i) {
    fd::Rng rng(1, 0, i);
    auto [x, y, w, h] = fd::random_resized_crop_box(500, 375, o, rng);
    ASSERT_GE(x, 0);
    ASSERT_GE(y, 0);
    ASSERT_LE(x + w, 500);
    ASSERT_LE(y + h, 375);
    double frac = double(w) * h / (500.0 * 375.0);
    EXPECT_GE(frac, 0.07);
    double ratio = double(w) / h;
    EXPECT_GE(ratio, 0.74);
    EXPECT_LE(ratio, 1.34);
    fallbacks += (w == 500 && h == 375) ? 1 : 0;
  }
  EXPECT_LT(fallbacks, 20);
  // A strip no crop of ratio 3/4..4/3 fits: the central crop, its ratio clamped to 4/3.
  fd::Rng rng(2, 0, 0);
  o.scale_min = 0.9;
  auto box = fd::random_resized_crop_box(1000, 10, o, rng);
  EXPECT_EQ(box, (std::array<int, 4>{493, 0, 13, 10}));
}

TEST(ImageTransform, EvalCentersAndNormalizesAndFlipIsAMirror) {
  const int w = 400, h = 300;
  auto jpg = ft::encode_jpeg(picture(w, h), w, h, 95);
  fd::Sample s{jpg, 0, "pic.jpg"};
  fd::ImageTransform eval_u8(
      {.train = false, .dtype = fd::DType::kUInt8, .layout = fd::Layout::kNHWC});
  std::vector<std::byte> out(eval_u8.output().bytes());
  fd::Rng rng(0, 0, 0);
  eval_u8.apply(s, out, rng);
  // The centre pixel of the output is the centre of the picture.
  auto* px = reinterpret_cast<const uint8_t*>(out.data()) + (112 * 224 + 112) * 3;
  EXPECT_NEAR(px[0], 255.0 * 200 / 399, 4);
  EXPECT_NEAR(px[1], 255.0 * 150 / 299, 4);
  // float32 NCHW is the same pixels, normalized.
  fd::ImageTransform eval_f({.train = false});
  std::vector<std::byte> f(eval_f.output().bytes());
  eval_f.apply(s, f, rng);
  const float* fp = reinterpret_cast<const float*>(f.data());
  EXPECT_NEAR(fp[112 * 224 + 112], (px[0] / 255.0 - 0.485) / 0.229, 1e-4);
  EXPECT_NEAR(fp[224 * 224 + 112 * 224 + 112], (px[1] / 255.0 - 0.456) / 0.224, 1e-4);
  // Train with flip always / never, full-image crops: mirrored.
  fd::ImageOptions always{.train = true,
                          .scale_min = 1,
                          .ratio_min = 4.0 / 3,
                          .ratio_max = 4.0 / 3,
                          .flip = 1.0,
                          .dtype = fd::DType::kUInt8,
                          .layout = fd::Layout::kNHWC};
  auto never = always;
  never.flip = 0.0;
  std::vector<std::byte> a(eval_u8.output().bytes()), b(a.size());
  fd::Rng r1(3, 0, 0), r2(3, 0, 0);
  fd::ImageTransform(always).apply(s, a, r1);
  fd::ImageTransform(never).apply(s, b, r2);
  for (int y = 0; y < 224; y += 37) {
    for (int x = 0; x < 224; x += 29) {
      for (int c = 0; c < 3; ++c) {
        ASSERT_EQ(a[(y * 224 + x) * 3 + c], b[(y * 224 + 223 - x) * 3 + c]);
      }
    }
  }
  // Rebuilt from its description (fork-server workers), the same transform.
  auto again = fd::make_transform(*fd::ImageTransform(always).describe());
  std::vector<std::byte> c2(a.size());
  fd::Rng r3(3, 0, 0);
  again->apply(s, c2, r3);
  EXPECT_EQ(c2, a);
}
