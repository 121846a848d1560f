#include "data/image/decode.hpp"

#include <fmt/format.h>
#include <png.h>
#include <setjmp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

// jpeglib.h needs FILE and size_t declared first.
#include <jerror.h>
#include <jpeglib.h>

#include "forkguard/data/error.hpp"

namespace forkguard::data::image {
namespace {

struct JpegError {
  jpeg_error_mgr mgr;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void on_jpeg_error(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->message);
  longjmp(e->jump, 1);
}

// Warnings are ignored, as Pillow ignores them, except a premature end of data: a truncated file
// is a bad sample (Pillow: "image file is truncated"), not an image with a grey bottom.
void on_jpeg_message(j_common_ptr cinfo, int level) {
  if (level == -1 && cinfo->err->msg_code == JWRN_JPEG_EOF) {
    auto* e = reinterpret_cast<JpegError*>(cinfo->err);
    std::snprintf(e->message, sizeof e->message, "truncated JPEG (premature end of data)");
    longjmp(e->jump, 1);
  }
}

bool is_jpeg(const uint8_t* d, size_t n) {
  return n >= 3 && d[0] == 0xFF && d[1] == 0xD8 && d[2] == 0xFF;
}
bool is_png(const uint8_t* d, size_t n) {
  static const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  return n >= 8 && std::memcmp(d, sig, 8) == 0;
}

void check_pixels(const std::string& name, uint64_t w, uint64_t h, uint64_t max) {
  if (w == 0 || h == 0) throw DataError(fmt::format("{}: image has no pixels ({}x{})", name, w, h));
  if (w * h > max) {
    throw DataError(
        fmt::format("{}: {}x{} = {} pixels, more than max_pixels ({}); refusing to "
                    "decode (a decompression bomb?)",
                    name, w, h, w * h, max));
  }
}

// The columns/rows [lo, hi) a resampling of [b0, b1) to `out` pixels reads (Pillow's bilinear
// support, one pixel of slack), clamped to [0, size).
void span(double b0, double b1, int out, int size, int* lo, int* hi) {
  double support = std::max(1.0, (b1 - b0) / out) + 1.0;
  *lo = std::clamp(static_cast<int>(std::floor(b0 - support)), 0, size);
  *hi = std::clamp(static_cast<int>(std::ceil(b1 + support)), *lo, size);
}

Region decode_jpeg(const uint8_t* data, size_t size, const std::string& name,
                   const DecodeOptions& o, const std::function<Box(int, int)>& choose_box) {
  // Everything with a destructor lives before setjmp: longjmp never skips one.
  Region r;
  Pixels cmyk;
  std::vector<JSAMPROW> rows;
  std::string failure;
  jpeg_decompress_struct cinfo{};
  JpegError err{};
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = on_jpeg_error;
  err.mgr.emit_message = on_jpeg_message;
  if (setjmp(err.jump) != 0) {
    jpeg_destroy_decompress(&cinfo);
    throw DataError(fmt::format("{}: corrupt JPEG: {}", name, err.message));
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  const int W = static_cast<int>(cinfo.image_width), H = static_cast<int>(cinfo.image_height);
  if (W <= 0 || H <= 0 || static_cast<uint64_t>(W) * static_cast<uint64_t>(H) > o.max_pixels) {
    jpeg_destroy_decompress(&cinfo);
    check_pixels(name, static_cast<uint64_t>(W), static_cast<uint64_t>(H), o.max_pixels);
  }
  Box box = choose_box(W, H);
  int denom = 1;
  if (o.crop_aware) {
    for (int d : {8, 4, 2}) {
      if (box.width() / d >= o.out_width && box.height() / d >= o.out_height) {
        denom = d;
        break;
      }
    }
  }
  const bool four = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  const bool adobe_inverted = four && cinfo.saw_Adobe_marker;
  cinfo.out_color_space = four ? JCS_CMYK : JCS_RGB;
  cinfo.scale_num = 1;
  cinfo.scale_denom = static_cast<unsigned>(denom);
  cinfo.dct_method = JDCT_ISLOW;
  jpeg_calc_output_dimensions(&cinfo);
  const int sw = static_cast<int>(cinfo.output_width), sh = static_cast<int>(cinfo.output_height);
  // The box in the scaled image.
  const double fx = static_cast<double>(sw) / W, fy = static_cast<double>(sh) / H;
  Box sbox{box.x0 * fx, box.y0 * fy, box.x1 * fx, box.y1 * fy};
  int cx0 = 0, cx1 = sw, cy0 = 0, cy1 = sh;
  if (o.crop_aware) {
    span(sbox.x0, sbox.x1, o.out_width, sw, &cx0, &cx1);
    span(sbox.y0, sbox.y1, o.out_height, sh, &cy0, &cy1);
  }
  jpeg_start_decompress(&cinfo);
  JDIMENSION xoff = static_cast<JDIMENSION>(cx0), width = static_cast<JDIMENSION>(cx1 - cx0);
  if (o.crop_aware && (cx0 > 0 || cx1 < sw)) jpeg_crop_scanline(&cinfo, &xoff, &width);
  const int comps = cinfo.output_components;
  const int rw = static_cast<int>(cinfo.output_width);  // after the crop
  const int rh = cy1 - cy0;
  auto& buf = four ? cmyk : r.rgb;
  buf.resize(static_cast<size_t>(rw) * static_cast<size_t>(rh) * static_cast<size_t>(comps));
  if (cy0 > 0) jpeg_skip_scanlines(&cinfo, static_cast<JDIMENSION>(cy0));
  rows.resize(static_cast<size_t>(rh));
  for (int y = 0; y < rh; ++y)
    rows[static_cast<size_t>(y)] = buf.data() + static_cast<size_t>(y) * rw * comps;
  while (cinfo.output_scanline < static_cast<JDIMENSION>(cy1)) {
    const int done = static_cast<int>(cinfo.output_scanline) - cy0;
    jpeg_read_scanlines(&cinfo, rows.data() + done, static_cast<JDIMENSION>(rh - done));
  }
  jpeg_abort_decompress(&cinfo);  // the rows below the crop are never decoded
  jpeg_destroy_decompress(&cinfo);
  if (four) {
    r.rgb.resize(static_cast<size_t>(rw) * rh * 3);
    for (size_t i = 0, n = static_cast<size_t>(rw) * rh; i < n; ++i) {
      int c = cmyk[4 * i], m = cmyk[4 * i + 1], y = cmyk[4 * i + 2], k = cmyk[4 * i + 3];
      if (!adobe_inverted) c = 255 - c, m = 255 - m, y = 255 - y, k = 255 - k;
      r.rgb[3 * i] = static_cast<uint8_t>(c * k / 255);
      r.rgb[3 * i + 1] = static_cast<uint8_t>(m * k / 255);
      r.rgb[3 * i + 2] = static_cast<uint8_t>(y * k / 255);
    }
  }
  r.width = rw;
  r.height = rh;
  r.scale_denom = denom;
  r.box = {sbox.x0 - xoff, sbox.y0 - cy0, sbox.x1 - xoff, sbox.y1 - cy0};
  return r;
}

Region decode_png(const uint8_t* data, size_t size, const std::string& name, const DecodeOptions& o,
                  const std::function<Box(int, int)>& choose_box) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  if (png_image_begin_read_from_memory(&img, data, size) == 0) {
    std::string why = img.message;
    png_image_free(&img);
    throw DataError(fmt::format("{}: corrupt PNG: {}", name, why));
  }
  if (static_cast<uint64_t>(img.width) * img.height > o.max_pixels || img.width == 0 ||
      img.height == 0) {
    png_image_free(&img);
    check_pixels(name, img.width, img.height, o.max_pixels);
  }
  // RGBA, then the alpha dropped: what Pillow's convert("RGB") does (no compositing).
  img.format = PNG_FORMAT_RGBA;
  std::vector<uint8_t> rgba(PNG_IMAGE_SIZE(img));
  if (png_image_finish_read(&img, nullptr, rgba.data(), 0, nullptr) == 0) {
    std::string why = img.message;
    png_image_free(&img);
    throw DataError(fmt::format("{}: corrupt PNG: {}", name, why));
  }
  Region r;
  r.width = static_cast<int>(img.width);
  r.height = static_cast<int>(img.height);
  r.rgb.resize(static_cast<size_t>(r.width) * r.height * 3);
  for (size_t i = 0, n = static_cast<size_t>(r.width) * r.height; i < n; ++i) {
    std::memcpy(&r.rgb[3 * i], &rgba[4 * i], 3);
  }
  r.box = choose_box(r.width, r.height);
  return r;
}

}  // namespace

Region decode(const uint8_t* data, size_t size, const std::string& name, const DecodeOptions& o,
              const std::function<Box(int, int)>& choose_box) {
  if (size == 0) throw DataError(fmt::format("{}: empty file (0 bytes)", name));
  if (is_jpeg(data, size)) return decode_jpeg(data, size, name, o, choose_box);
  if (is_png(data, size)) return decode_png(data, size, name, o, choose_box);
  throw DataError(fmt::format("{}: not an image (neither JPEG nor PNG)", name));
}

}  // namespace forkguard::data::image
