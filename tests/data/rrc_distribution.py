"""forkguard's RandomResizedCrop boxes against torchvision's, as distributions (issue 5): for
several image shapes, N boxes from each (forkguard: image_tool --rrc; torchvision:
RandomResizedCrop.get_params with torch's generator), and two-sample Kolmogorov-Smirnov tests on
the area fraction, the log aspect ratio and the relative x and y positions, plus the rate of the
central fallback crop. The same statistics must tell apart a sampler that is slightly wrong
(scale (0.10, 1) instead of (0.08, 1)), so the test can fail.
Run: /usr/bin/python3 rrc_distribution.py IMAGE_TOOL. Exit 77 when torchvision is missing."""
import math
import subprocess
import sys

try:
    import numpy as np
    import torch
    from torchvision.transforms import RandomResizedCrop
except ImportError:
    print("skipped: torch/torchvision/numpy not installed (python3-torchvision python3-numpy)")
    sys.exit(77)

N = 40000
SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)
SHAPES = [(500, 375), (375, 500), (224, 224), (1000, 120)]  # the last: many fallbacks


def ks(a, b):
    """Two-sample Kolmogorov-Smirnov statistic and its critical value at alpha = 0.001."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    d = np.max(np.abs(np.searchsorted(a, grid, "right") / len(a) -
                      np.searchsorted(b, grid, "right") / len(b)))
    crit = 1.949 * math.sqrt((len(a) + len(b)) / (len(a) * len(b)))
    return d, crit


def features(boxes, w, h):
    x, y, bw, bh = (boxes[:, k].astype(np.float64) for k in range(4))
    rel_x = np.where(bw < w, x / np.maximum(w - bw, 1), 0.5)
    rel_y = np.where(bh < h, y / np.maximum(h - bh, 1), 0.5)
    return {"area": bw * bh / (w * h), "log_ratio": np.log(bw / bh), "rel_x": rel_x, "rel_y": rel_y}


def fallback_rate(boxes, w, h):
    # torchvision's fallback is the central crop of the clamped ratio; a drawn box rarely is.
    in_ratio = w / h
    fw, fh = w, h
    if in_ratio < RATIO[0]:
        fh = int(round(fw / RATIO[0]))
    elif in_ratio > RATIO[1]:
        fw = int(round(fh * RATIO[1]))
    central = (boxes[:, 0] == (w - fw) // 2) & (boxes[:, 1] == (h - fh) // 2) & \
              (boxes[:, 2] == fw) & (boxes[:, 3] == fh)
    return float(central.mean())


def torchvision_boxes(w, h, scale):
    torch.manual_seed(1234)
    img = torch.empty(3, h, w)  # get_params reads only the size
    out = np.empty((N, 4), dtype=np.int64)
    for k in range(N):
        i, j, bh, bw = RandomResizedCrop.get_params(img, list(scale), list(RATIO))
        out[k] = (j, i, bw, bh)
    return out


def ours(tool, w, h, scale, seed=7):
    text = subprocess.run([tool, "--rrc", str(w), str(h), str(N), str(seed), str(scale[0]),
                           str(scale[1])], check=True, capture_output=True, text=True).stdout
    return np.array([list(map(int, line.split())) for line in text.splitlines()], dtype=np.int64)


def compare(a, b, w, h):
    """The worst KS statistic relative to its critical value, and the fallback rates' z score."""
    fa, fb = features(a, w, h), features(b, w, h)
    worst, report = 0.0, []
    for name in fa:
        d, crit = ks(fa[name], fb[name])
        worst = max(worst, d / crit)
        report.append(f"{name} D={d:.4f} (crit {crit:.4f})")
    pa, pb = fallback_rate(a, w, h), fallback_rate(b, w, h)
    p = (pa + pb) / 2
    z = abs(pa - pb) / math.sqrt(max(p * (1 - p), 1e-12) * 2 / N)
    report.append(f"fallback {pa:.4f} vs {pb:.4f} (z={z:.2f})")
    return worst, z, "; ".join(report)


def main():
    tool = sys.argv[1]
    failures = []
    for w, h in SHAPES:
        ref = torchvision_boxes(w, h, SCALE)
        worst, z, report = compare(ours(tool, w, h, SCALE), ref, w, h)
        print(f"{w}x{h}: {report}")
        if worst >= 1.0 or z >= 3.29:
            failures.append(f"{w}x{h}: forkguard's boxes differ from torchvision's: {report}")
    # Power: a slightly wrong sampler is told apart on the same statistics.
    w, h = SHAPES[0]
    worst, z, report = compare(ours(tool, w, h, (0.10, 1.0)), torchvision_boxes(w, h, SCALE), w, h)
    print(f"negative control, scale (0.10, 1): {report}")
    if worst < 1.0 and z < 3.29:
        failures.append("the test cannot tell scale (0.10, 1) from (0.08, 1): too weak")
    if failures:
        print("FAIL:", *failures, sep="\n  ")
        return 1
    print(f"forkguard's RandomResizedCrop matches torchvision's distribution ({N} draws per shape)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
