"""PyTorch side of `cargo bench --bench amp`: the same MLP, batch and thread count, timed as
plain fp32 training and as PyTorch's native AMP on CPU (torch.autocast + GradScaler("cpu")).
Prints one JSON object: {"fp32": ms, "amp_fp16": ms, "amp_bf16": ms, "threads": n}."""
import argparse, json, statistics, time

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=128)
p.add_argument("--hidden", type=int, default=1024)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--threads", type=int, default=0)
p.add_argument("--native-steps", type=int, default=3)
a = p.parse_args()
if a.threads:
    torch.set_num_threads(a.threads)
torch.manual_seed(0)


def make():
    return nn.Sequential(nn.Linear(784, a.hidden), nn.BatchNorm1d(a.hidden), nn.ReLU(),
                         nn.Linear(a.hidden, a.hidden), nn.ReLU(), nn.Linear(a.hidden, 10))


x = torch.randn(a.batch, 784)
y = torch.randint(0, 10, (a.batch,))


def bench(mode, steps):
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if mode == "amp_fp16" else None
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        opt.zero_grad()
        if mode == "fp32":
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        else:
            dtype = torch.float16 if mode == "amp_fp16" else torch.bfloat16
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.cross_entropy(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        if i >= 2:
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


out = {"threads": torch.get_num_threads(), "fp32": bench("fp32", a.steps),
       "amp_fp16": bench("amp_fp16", a.native_steps), "amp_bf16": bench("amp_bf16", a.native_steps)}
print(json.dumps(out))
