// image_tool FILE X0 Y0 X1 Y1 SIZE [--full]: the box of FILE resampled to SIZE x SIZE by
// forkguard's image pipeline (crop-aware decode unless --full), as raw RGB on stdout. Used by
// tests/data/pillow_compare.py to hold the pipeline to Pillow's output.
// image_tool --rrc WIDTH HEIGHT N SEED SCALE_MIN SCALE_MAX: N RandomResizedCrop boxes ("x y w h"
// per line) of a WIDTH x HEIGHT image, sample i drawn from Rng(SEED, 0, i), as the loader draws
// them. Used by tests/data/rrc_distribution.py to compare with torchvision's.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "data/image/decode.hpp"
#include "data/image/resample.hpp"
#include "forkguard/data/image_folder.hpp"
#include "forkguard/data/image_transform.hpp"

int main(int argc, char** argv) {
  if (argc == 8 && std::string(argv[1]) == "--rrc") {
    forkguard::data::ImageOptions o;
    const int w = std::atoi(argv[2]), h = std::atoi(argv[3]);
    const long n = std::atol(argv[4]);
    const auto seed = std::strtoull(argv[5], nullptr, 10);
    o.scale_min = std::atof(argv[6]);
    o.scale_max = std::atof(argv[7]);
    for (long i = 0; i < n; ++i) {
      forkguard::data::Rng rng(seed, 0, static_cast<uint64_t>(i));
      auto [x, y, bw, bh] = forkguard::data::random_resized_crop_box(w, h, o, rng);
      std::printf("%d %d %d %d\n", x, y, bw, bh);
    }
    return 0;
  }
  if (argc < 7) {
    std::fprintf(stderr, "usage: image_tool FILE X0 Y0 X1 Y1 SIZE [--full]\n");
    return 2;
  }
  namespace fi = forkguard::data::image;
  try {
    auto bytes = forkguard::data::read_file_bytes(argv[1]);
    fi::Box box{std::atof(argv[2]), std::atof(argv[3]), std::atof(argv[4]), std::atof(argv[5])};
    const int size = std::atoi(argv[6]);
    const bool full = argc > 7 && std::string(argv[7]) == "--full";
    auto r = fi::decode(bytes.data(), bytes.size(), argv[1], {100'000'000, size, size, !full},
                        [&](int, int) { return box; });
    std::vector<uint8_t> out(static_cast<size_t>(size) * size * 3);
    fi::resample(r.rgb.data(), r.width, r.height, r.box, size, size, out.data());
    std::fwrite(out.data(), 1, out.size(), stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
