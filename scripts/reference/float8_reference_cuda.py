"""The CUDA cases of float8_reference.py (tests/cuda/float8.rs, feature cuda-tests): torchao's
tensorwise and rowwise recipes and TE's delayed scaling on the GPU, fp32 and under CUDA bf16
autocast, in the same file layout.

    $TCH_AMP_PYTHON scripts/reference/float8_reference_cuda.py OUT.safetensors
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import float8_reference  # noqa: E402

if __name__ == "__main__":
    float8_reference.main("cuda")
