// The standard image pipelines, torchvision-equivalent, as one fused Transform:
//   train: decode -> RandomResizedCrop(size, scale, ratio) -> RandomHorizontalFlip(p) -> Normalize
//   eval:  decode -> Resize(resize, shorter side) -> CenterCrop(size) -> Normalize
// Output: float32 or float16 NCHW (normalized), or uint8 NCHW / NHWC (not normalized).
//
//   auto tf = std::make_shared<forkguard::data::ImageTransform>(
//       forkguard::data::ImageOptions{.train = true, .size = 224});
//
// RandomResizedCrop samples as torchvision does (ten attempts at an area in `scale` and a
// log-uniform aspect ratio in `ratio`, then the clamped central crop), from the sample's Rng.
// JPEGs are decoded crop-aware: only the crop's rows and columns (plus the filter's support), at
// the largest DCT scale-down (1/2, 1/4, 1/8) that keeps the crop at least `size`. Resampling is
// Pillow's antialiased bilinear. Bad input (not an image, corrupt or truncated data, more pixels
// than max_pixels) throws DataError naming the sample.
#pragma once

#include <array>
#include <cstdint>

#include "forkguard/data/transform.hpp"

namespace forkguard::data {

struct ImageOptions {
  bool train = true;                         // RandomResizedCrop + flip, else Resize + CenterCrop
  int size = 224;                            // output height and width
  double scale_min = 0.08, scale_max = 1.0;  // RandomResizedCrop's scale
  double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;  // ... and aspect ratio
  double flip = 0.5;                                    // RandomHorizontalFlip's p (train)
  int resize = 256;                                     // eval: the shorter side before CenterCrop
  std::array<float, 3> mean{0.485f, 0.456f, 0.406f};    // Normalize (float outputs)
  std::array<float, 3> std{0.229f, 0.224f, 0.225f};
  DType dtype = DType::kFloat32;      // kFloat32, kFloat16 or kUInt8
  Layout layout = Layout::kNCHW;      // kNCHW; kNHWC for uint8 only
  uint64_t max_pixels = 100'000'000;  // refuse larger images before allocating
  bool crop_aware = true;             // false: full-size decode (for comparisons)
};

class ImageTransform : public Transform {
 public:
  explicit ImageTransform(ImageOptions options);
  std::string name() const override { return options_.train ? "image-train" : "image-eval"; }
  OutputSpec output() const override;
  void apply(const Sample& in, std::span<std::byte> out, Rng& rng) const override;
  std::optional<Description> describe() const override;
  const ImageOptions& options() const { return options_; }

 private:
  ImageOptions options_;
};

// torchvision's RandomResizedCrop.get_params: (x, y, w, h) of the crop in a width x height image.
std::array<int, 4> random_resized_crop_box(int width, int height, const ImageOptions& o, Rng& rng);

}  // namespace forkguard::data
