"""PyTorch side of `cargo bench --bench amp`: the same three models, batches, optimizer and
thread count as the Rust side, timed as plain fp32 training and as PyTorch's native AMP
(torch.autocast + GradScaler for fp16; autocast alone, or with a GradScaler, for bf16).

It runs as a server so that the benchmark can interleave PyTorch configurations with its own
(ABAB...), which is what makes ratios between them meaningful on a busy machine:

    python scripts/bench_torch.py --serve --threads 2 --device cpu --optimizer adam

prints one JSON line {"ready": true, "torch": "2.13.0", "threads": 2, "configs": [...]}, then
answers each line `run <workload> <config> <steps>` with one JSON line
{"ms": [per-step milliseconds...]} (after one untimed step), and each line
`scaler <workload> <iterations>` with {"ms": [...]}: the time of GradScaler's
`unscale_(opt)` + `update()` on the workload's fp32 gradients (restored, untimed, before each
iteration), until `quit` or end of input.

Workloads (keep in step with benches/amp.rs):
- mlp: 784-1024-1024-10, batch norm after the first layer, ReLU; batch 128 of 784 features.
- cnn: `make demo`'s small ResNet (examples/common/model.rs: width 16, 2 stages, pool 7);
  batch 128 of 1x28x28.
- transformer: 2 pre-LN encoder blocks (d 256, 4 heads, feed-forward 1024, GELU, softmax
  attention written out), final LayerNorm, mean over tokens, linear head; batch 8 x 64
  tokens of 256 features.
Configs: fp32, amp_bf16 (autocast bf16), amp_bf16_scaler (autocast bf16 + GradScaler),
amp_fp16 (autocast fp16 + GradScaler), and on CUDA also tf32.
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--serve", action="store_true", help="answer `run` lines on stdin (see the module doc)")
p.add_argument("--threads", type=int, default=0)
p.add_argument("--device", default="cpu")
p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
p.add_argument("--adam-kernel", choices=["fused", "single"], default="fused",
               help="torch.optim.Adam(fused=True), or its single-tensor algorithm (foreach=False)")
p.add_argument("--workloads", default="mlp,cnn,transformer")
p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
               help="wall clock, or the calling thread's CPU time (with --threads 1)")
a = p.parse_args()
if a.threads:
    torch.set_num_threads(a.threads)
device = torch.device(a.device)


def mlp(h=1024):
    return nn.Sequential(nn.Linear(784, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))


def mlp_big():
    return mlp(4096)


def resnet50():
    import torchvision  # only the GPU-sized workload needs it
    return torchvision.models.resnet50(num_classes=1000)


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        s = x if self.shortcut is None else self.shortcut(x)
        return F.relu(y + s)


class SmallResNet(nn.Module):
    def __init__(self, width=16, stages=2, pool=7, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, 1, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(width)
        blocks, c = [], width
        for i in range(stages):
            cout = c if i == 0 else 2 * c
            blocks.append(Block(c, cout, 2))
            c = cout
        self.blocks = nn.Sequential(*blocks)
        self.pool = pool
        self.fc = nn.Linear(c * pool * pool, classes)

    def forward(self, x):
        x = F.relu(self.stem_bn(self.stem(x)))
        x = self.blocks(x)
        x = F.adaptive_avg_pool2d(x, self.pool).flatten(1)
        return self.fc(x)


class EncoderBlock(nn.Module):
    def __init__(self, d=256, heads=4, ff=1024):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, ff)
        self.ff2 = nn.Linear(ff, d)

    def forward(self, x):
        b, s, d = x.shape
        h, dh = self.heads, d // self.heads
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, h, dh).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = (q.matmul(k.transpose(-2, -1)) * (1.0 / math.sqrt(dh))).softmax(-1)
        o = att.matmul(v).transpose(1, 2).reshape(b, s, d)
        x = x + self.out(o)
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class Encoder(nn.Module):
    def __init__(self, d=256, heads=4, ff=1024, layers=2, classes=10):
        super().__init__()
        self.layers = nn.Sequential(*[EncoderBlock(d, heads, ff) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.ln(self.layers(x)).mean(1))


WORKLOADS = {
    "mlp": (mlp, (128, 784)),
    "cnn": (SmallResNet, (128, 1, 28, 28)),
    "transformer": (Encoder, (8, 64, 256)),
    "mlp-big": (mlp_big, (2048, 784)),
    "resnet50": (resnet50, (128, 3, 224, 224)),
}


class Config:
    def __init__(self, workload, mode):
        torch.manual_seed(0)
        make, shape = WORKLOADS[workload]
        self.model = make().to(device)
        self.x = torch.randn(*shape, device=device)
        self.y = torch.randint(0, 10, (shape[0],), device=device)
        params = self.model.parameters()
        if a.optimizer == "adam":
            # The same update algorithm as the Rust rows (--adam-kernel).
            fused = a.adam_kernel == "fused"
            self.opt = torch.optim.Adam(params, lr=1e-3, fused=fused, foreach=False if not fused else None)
        else:
            self.opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
        self.mode = mode
        with_scaler = mode in ("amp_fp16", "amp_bf16_scaler")
        self.scaler = torch.amp.GradScaler(device.type) if with_scaler else None

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        if self.mode in ("fp32", "tf32"):
            loss = F.cross_entropy(self.model(self.x), self.y)
            loss.backward()
            self.opt.step()
            return
        dtype = torch.float16 if self.mode == "amp_fp16" else torch.bfloat16
        with torch.autocast(device.type, dtype=dtype):
            loss = F.cross_entropy(self.model(self.x), self.y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


def set_tf32(on):
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


def scaler_times(workload, iterations, clock):
    """GradScaler's unscale_ + update on the fp32 gradients of one scaled backward of the
    workload (the benches/amp.rs side does the same with tch_amp::GradScaler)."""
    c = Config(workload, "fp32")
    scaler = torch.amp.GradScaler(device.type)
    c.opt.zero_grad(set_to_none=True)
    scaler.scale(F.cross_entropy(c.model(c.x), c.y)).backward()
    params = [p for p in c.model.parameters() if p.grad is not None]
    saved = [p.grad.clone() for p in params]

    def restore():
        with torch.no_grad():
            for p, g in zip(params, saved):
                p.grad.copy_(g)

    restore()
    scaler.unscale_(c.opt)  # untimed: first call
    scaler.update()
    ms = []
    for _ in range(iterations):
        restore()
        sync()
        t = clock()
        scaler.unscale_(c.opt)
        scaler.update()
        sync()
        ms.append((clock() - t) * 1e3)
    return ms


def serve():
    modes = ["fp32", "amp_bf16", "amp_bf16_scaler", "amp_fp16"] + (["tf32"] if device.type == "cuda" else [])
    configs = {}
    print(json.dumps({"ready": True, "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "configs": modes}), flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] == "quit":
            break
        clock = time.thread_time if a.clock == "cpu" else time.perf_counter
        if parts[0] == "scaler":
            _, workload, iterations = parts
            print(json.dumps({"ms": scaler_times(workload, int(iterations), clock)}), flush=True)
            continue
        _, workload, mode, steps = parts
        key = (workload, mode)
        if key not in configs:
            configs[key] = Config(workload, mode)
        c = configs[key]
        set_tf32(mode == "tf32")
        c.step()  # untimed: settles caches after the other configurations ran
        sync()
        ms, syncs = [], []
        for _ in range(int(steps)):
            t = clock()
            if device.type == "cuda":
                # Count the step's host syncs with PyTorch's sync debug mode (warnings).
                import warnings
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode(1)
                    c.step()
                    torch.cuda.set_sync_debug_mode(0)
                syncs.append(sum("synchroniz" in str(w.message) for w in caught))
            else:
                c.step()
            sync()
            ms.append((clock() - t) * 1e3)
        set_tf32(False)
        out = {"ms": ms}
        if syncs:
            out["syncs"] = sorted(syncs)[len(syncs) // 2]
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if not a.serve:
        sys.exit("bench_torch.py is driven by `cargo bench --bench amp` (it runs with --serve)")
    serve()
