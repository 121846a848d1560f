"""forkguard's decode + resample against Pillow's, on the same crop boxes: for each image and box,
the mean absolute difference of Image.resize(size, BILINEAR, box) and forkguard's output must be
under 2 grey levels (issue 5). JPEGs like the benchmark's (quality 90, 4:2:0) and PNGs of every
colour type. Run: /usr/bin/python3 pillow_compare.py IMAGE_TOOL. Exit 77 when Pillow is missing."""
import os
import random
import subprocess
import sys
import tempfile

try:
    import numpy as np
    from PIL import Image
except ImportError:
    print("skipped: Pillow and numpy not installed (python3-pil python3-numpy)")
    sys.exit(77)


def picture(rng, w, h):
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([xx / w * 255, yy / h * 255, 128 + 100 * np.sin(xx / 17.0) * np.cos(yy / 23.0)], -1)
    noise = np.asarray(rng.normal(0, 12, (h, w, 3)), dtype=np.float32)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def main():
    tool = sys.argv[1]
    rng = np.random.default_rng(5)
    prng = random.Random(5)
    worst = 0.0
    failures = []
    with tempfile.TemporaryDirectory() as d:
        files = []
        for i, (w, h) in enumerate([(500, 375), (800, 600), (333, 640), (1200, 900)]):
            path = os.path.join(d, f"img{i}.jpg")
            picture(rng, w, h).save(path, quality=90, subsampling=2)
            files.append(path)
        rgba = picture(rng, 320, 240).convert("RGBA")
        rgba.putalpha(Image.fromarray(np.asarray(rng.integers(0, 256, (240, 320)), dtype=np.uint8)))
        for mode in ["RGB", "RGBA", "L", "LA", "P"]:
            path = os.path.join(d, f"png_{mode}.png")
            (rgba if mode == "RGBA" else rgba.convert(mode)).save(path)
            files.append(path)
        for path in files:
            with Image.open(path) as im:
                ref_img = im.convert("RGB")
            w, h = ref_img.size
            for k in range(6):
                size = prng.choice([224, 160, 96])
                bw = prng.uniform(0.1, 1.0) * w
                bh = min(h, bw * prng.uniform(0.75, 1.33))
                x0 = prng.uniform(0, w - bw)
                y0 = prng.uniform(0, h - bh)
                box = (x0, y0, x0 + bw, y0 + bh)
                ref = np.asarray(ref_img.resize((size, size), Image.BILINEAR, box=box), dtype=np.int16)
                for flag in ([], ["--full"]):
                    out = subprocess.run([tool, path, *map(str, box), str(size), *flag],
                                         check=True, capture_output=True).stdout
                    ours = np.frombuffer(out, dtype=np.uint8).reshape(size, size, 3).astype(np.int16)
                    diff = float(np.abs(ours - ref).mean())
                    worst = max(worst, diff)
                    label = f"{os.path.basename(path)} box={tuple(round(b, 1) for b in box)} size={size} {'full' if flag else 'crop-aware'}"
                    print(f"{diff:6.3f}  {label}")
                    if diff >= 2.0:
                        failures.append(label)
    print(f"worst mean absolute difference: {worst:.3f} grey levels (limit 2)")
    if failures:
        print("FAIL:", *failures, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
