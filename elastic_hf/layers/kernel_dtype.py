"""Activation dtype for the aten int-pack kernels (W8 / W4 layers on CUDA, and on CPUs or shapes that
native/quant_gemm.c does not take).

Both kernels have their vectorized (AVX-512 / AVX2) CPU paths only for bf16 activations; fp32 and fp16 inputs
fall to a scalar loop. Measured on this project's 2-core AVX-512 CPU, 1 thread, 1536x576 weight:
fp32 activations W4 1.53 ms at M=1 and 389 ms at M=256, bf16 activations 0.052 ms and 5.3 ms (fp32 nn.Linear:
0.085 ms and 4.8 ms). So activations are cast to bf16 at the kernel boundary on CPU as on CUDA, and the output
back to the caller's dtype: the price is bf16 rounding of the activations (relative error ~4e-3)."""
from __future__ import annotations

import torch


INT_PACK_KERNEL_DTYPE = torch.bfloat16
