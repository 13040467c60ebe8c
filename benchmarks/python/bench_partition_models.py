"""Partition methods side by side on profiled traces of the bench models (issue 15): a decoder of
GPT-2-medium depth and ResNet-50, each profiled for one training step (forward, loss, backward,
AdamW) on this machine's CPU, then split over 2, 4 and 8 simulated H100 SXM (roofline op times:
CPU durations are not GPU times; NVLink 4 links, 450 GB/s each way + 5 us) at caps of 50% and 30%
of the step's single-device peak.

Reduced sizes, because the full ones do not profile on a 2-core CPU in reasonable time and memory:
the decoder has GPT-2-medium's 24 layers and 16 heads but d=256, sequence 128, vocabulary 8192,
batch 2 (benchmarks/gpu/bench_offload.py's Decoder class); ResNet-50 is torchvision's layout
(bottlenecks [3, 4, 6, 3], written out here: torchvision is not installed) on 64x64 images, batch 4.
Caps are relative to each trace's own peak, so the comparison does not depend on the scale.

Methods: s3 (memsched's C++ S3), s3-clusters (S3 with only its clustering start: the ablation of
the contiguous starts, Note [S3 partitioner]), even (layers split by count), flops (FLOP-balanced
contiguous split), metis (pymetis min-cut, when installed). The exact MILP does not scale to these
graphs (thousands of ops) and is compared on small random graphs in tests/python/partition/test_milp.py.

Asserts, per cell: where any baseline fits, s3 fits and its makespan is <= that baseline's; where s3
does not fit, no baseline does. Prints and saves bench_out/partition_models.md.

Run: python -m pytest -q benchmarks/python/bench_partition_models.py -s
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memsched
from memsched.partition import compare

OUT_DIR = os.environ.get("MEMSCHED_BENCH_OUT", "bench_out")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))

# MEMSCHED_PARTITION_GPT="1024,50257": GPT-2-medium's own width and vocabulary (about 6 GB and a
# few minutes to profile on this machine); the default is the reduced decoder described above.
GPT_WIDTH, GPT_VOCAB = (int(v) for v in os.environ.get("MEMSCHED_PARTITION_GPT", "256,8192").split(","))
DEVICE_COUNTS = (2, 4, 8)
CAPS = ("50%", "30%")
METHODS = ["s3", "even", "flops", "metis"]
_TRACES = {}
_ROWS = []


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """torchvision.models.resnet50's layout."""

    def __init__(self, classes=1000):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, stages = 64, []
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            layers = []
            for b in range(blocks):
                layers.append(Bottleneck(cin, width, stride if b == 0 else 1))
                cin = width * 4
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(2048, classes)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _profile(name):
    if name in _TRACES:
        return _TRACES[name]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "gpt":
        from bench_offload import Decoder
        d, vocab = GPT_WIDTH, GPT_VOCAB
        model = Decoder(layers=24, d=d, heads=16, seq=128, vocab=vocab)
        tokens = torch.randint(0, vocab, (2, 129), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        loss_of = lambda: F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))  # noqa: E731
    else:
        model = ResNet50()
        x, y = torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, 1000, (4,), generator=g)
        loss_of = lambda: F.cross_entropy(model(x), y)  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # one update op chain per parameter

    def step():
        opt.zero_grad(set_to_none=True)
        loss_of().backward()
        opt.step()

    step()  # the optimizer's state exists before the profiled step, as in every later step
    _TRACES[name] = memsched.profile(step, model=model, optimizer=opt)
    return _TRACES[name]


@pytest.mark.parametrize("name", ["gpt", "resnet"])
@pytest.mark.parametrize("devices", DEVICE_COUNTS)
@pytest.mark.parametrize("cap", CAPS)
def test_s3_beats_or_equals_every_baseline(benchmark, name, devices, cap):
    trace = _profile(name)
    rows = benchmark.pedantic(compare, args=(trace, ["h100-sxm"] * devices, cap, METHODS),
                              kwargs=dict(durations="roofline"), rounds=1, iterations=1)
    h100 = memsched.load_device("h100-sxm")
    h100.use_measured_durations = False  # roofline, as compare(durations="roofline")
    problem = memsched._C.PartitionProblem(trace, [h100] * devices,
                                           [rows[0]["partition"].caps[0] if rows[0]["partition"] else 0] * devices)
    ablation = problem.s3(contiguous_starts=False) if rows[0]["partition"] else None
    by = {r["method"]: r for r in rows}
    s3 = by["s3"]
    for m in METHODS[1:]:
        r = by[m]
        if r["ok"]:
            assert s3["ok"], f"{name} {devices}x {cap}: {m} fits and s3 does not"
            assert s3["partition"].makespan_us <= r["partition"].makespan_us * (1 + 1e-9), (name, devices, cap, m)
    for r in rows:
        p = r["partition"]
        _ROWS.append((name, len(trace.ops), devices, cap, r["method"],
                      f"{p.makespan_us / 1e3:.3f}" if p else "-", memsched.format_bytes(max(p.peak_bytes)) if p else "-",
                      memsched.format_bytes(p.bytes_moved) if p else "-",
                      "yes" if r["ok"] else ("no" if p else r["error"][:40]), f"{r['seconds']:.2f}"))
    if not s3["ok"]:  # no method fits: the smallest equal cap S3 meets
        least = problem.least_uniform_cap()
        _ROWS.append((name, len(trace.ops), devices, cap, "least cap", "-", memsched.format_bytes(least),
                      f"{100 * least / trace.peak_bytes():.1f}% of peak", "-", "-"))
    if ablation is not None:
        a = ablation["eval"]
        _ROWS.append((name, len(trace.ops), devices, cap, "s3-clusters", f"{a['makespan_us'] / 1e3:.3f}",
                      memsched.format_bytes(max(a["peak_bytes"])), memsched.format_bytes(a["bytes_moved"]),
                      "yes" if ablation["fits"] else "no", f"{ablation['seconds']:.2f}"))


def teardown_module(module):
    if not _ROWS:
        return
    header = ("model", "ops", "devices", "cap", "method", "makespan ms", "max peak", "moved", "fits", "time s")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in _ROWS]
    peaks = {n: memsched.format_bytes(t.peak_bytes()) for n, t in _TRACES.items()}
    text = (f"Single-device peaks: {peaks}. Simulated H100 SXM, roofline op times, NVLink 450 GB/s.\n\n"
            + "\n".join(lines))
    print("\n" + text)
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "partition_models.md"), "w") as f:
        f.write(text + "\n")
