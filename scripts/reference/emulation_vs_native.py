"""Evidence for the CPU emulation defaults: for each GEMM/convolution class tch-amp can emulate,
how often its emulation contract (fp32 compute of the rounded fp16 inputs, output rounded once;
backward through the same casts) gives other fp16 bits than libtorch's native fp16 CPU kernel,
by how many ulps, and how long each takes (forward + backward, one thread).

    $TCH_AMP_PYTHON scripts/reference/emulation_vs_native.py [--threads 1] [--trials 20]

Prints a markdown table. Results depend on the CPU (which kernel libtorch picks for fp16:
oneDNN's AVX512-FP16/AMX kernels where the CPU has them, else its generic fp32-accumulating
loops) and on the shapes.
"""
import argparse
import time

import torch
import torch.nn.functional as F


def ulps(a, b):
    """|a - b| in fp16 ulps (ordered-integer distance of the bit patterns)."""
    def ordered(t):
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)
    return (ordered(a) - ordered(b)).abs()


def emulated(f, *args):
    return f(*[t.float() for t in args]).half()


CASES = [
    # name, op, input shapes (all fp16)
    ("linear 32x16->32 (MLP fc1)", lambda x, w, b: F.linear(x, w, b), [(32, 16), (32, 16), (32,)]),
    ("linear 32x784->256", lambda x, w, b: F.linear(x, w, b), [(32, 784), (256, 784), (256,)]),
    ("linear 4x8x16->64 (3-D input)", lambda x, w, b: F.linear(x, w, b), [(4, 8, 16), (64, 16), (64,)]),
    ("linear 128x512->512", lambda x, w, b: F.linear(x, w, b), [(128, 512), (512, 512), (512,)]),
    ("matmul 4x2x8x8 @ 4x2x8x8 (attention)", torch.matmul, [(4, 2, 8, 8), (4, 2, 8, 8)]),
    ("matmul 8x4x64x32 @ 8x4x32x64", torch.matmul, [(8, 4, 64, 32), (8, 4, 32, 64)]),
    ("bmm 16x64x64 @ 16x64x64", torch.bmm, [(16, 64, 64), (16, 64, 64)]),
    ("conv2d 8x3x8x8 -> 8, 3x3 (CNN conv1)", lambda x, w, b: F.conv2d(x, w, b, 1, 1), [(8, 3, 8, 8), (8, 3, 3, 3), (8,)]),
    ("conv2d 8x8x4x4 -> 16, 3x3 (CNN conv2)", lambda x, w, b: F.conv2d(x, w, b, 1, 1), [(8, 8, 4, 4), (16, 8, 3, 3), (16,)]),
    ("conv2d 32x32x16x16 -> 32, 3x3", lambda x, w, b: F.conv2d(x, w, b, 1, 1), [(32, 32, 16, 16), (32, 32, 3, 3), (32,)]),
]


def run(f, inputs, grad_out, emulate):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    y = emulated(f, *leaves) if emulate else f(*leaves)
    y.backward(grad_out)
    return y.detach(), [t.grad for t in leaves]


def timed(f, inputs, grad_out, emulate, reps):
    run(f, inputs, grad_out, emulate)
    t = time.perf_counter()
    for _ in range(reps):
        run(f, inputs, grad_out, emulate)
    return (time.perf_counter() - t) / reps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {a.threads} thread(s), {a.trials} random trials per op; "
          "differing = fp16 elements where emulation != native")
    print("| op | forward differing | backward differing (grads of every input) | max ulps | "
          "native fwd+bwd ms | emulated fwd+bwd ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, f, shapes in CASES:
        fwd = [0, 0]
        bwd = [0, 0]
        worst = 0
        for _ in range(a.trials):
            inputs = [(torch.randn(s, generator=g) / (s[-1] ** 0.5 if len(s) > 1 else 4)).half() for s in shapes]
            out_shape = f(*inputs).shape
            grad_out = torch.randn(out_shape, generator=g).half()
            yn, gn = run(f, inputs, grad_out, False)
            ye, ge = run(f, inputs, grad_out, True)
            fwd[0] += int((yn != ye).sum())
            fwd[1] += yn.numel()
            worst = max(worst, int(ulps(yn, ye).max()))
            for u, v in zip(gn, ge):
                bwd[0] += int((u != v).sum())
                bwd[1] += u.numel()
                worst = max(worst, int(ulps(u, v).max()))
        tn = timed(f, inputs, grad_out, False, a.reps)
        te = timed(f, inputs, grad_out, True, a.reps)
        print(f"| {name} | {fwd[0]}/{fwd[1]} ({100 * fwd[0] / fwd[1]:.3f}%) | {bwd[0]}/{bwd[1]} "
              f"({100 * bwd[0] / bwd[1]:.3f}%) | {worst} | {tn:.3f} | {te:.3f} |")


if __name__ == "__main__":
    main()
