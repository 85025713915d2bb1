"""The weight-only 4-bit matmul for skinny shapes on CUDA (decode and verification: at most
rayspec.model.fp4_linear.SKINNY_ROWS rows), in Triton: imported only when a CUDA forward needs it (Triton
ships with torch's CUDA builds; CPU runs never import it).

out[M, N] = x[M, K] @ W[N, K]^T, W read as its 4-bit codes (uint8 [N, K / 2], the even input in the low
nibble) and scales (uint8 [N, K / group]: FP8-E4M3 bits for NVFP4, E8M0 for MXFP4), times NVFP4's global
scale. Each program dequantizes a [BLOCK_N, BLOCK_K] tile in registers, in float32 in the format's order
((E2M1 * scale) * global, every power of two built from its bits, no exp2 approximation), rounds it to x's
dtype (the bits a dequantized weight holds) and accumulates the tile's dot product in float32. At batch 1
a decode reads each weight once: its time is the time to read the 4-bit bytes, which is the point.

Few rows leave most of a GPU idle when a program owns a column block over all of K, so K is split
(SPLIT_K programs per column block, chosen from N and K only, never from M) and the partial sums are
added afterwards in a fixed order (`sum(0)`): deterministic, and a row's result does not depend on how
many rows came with it at a given row tile (batch-invariant callers pass exactly 64).

Written for review and checked against the torch path in Triton's interpreter (TRITON_INTERPRET=1,
benchmarks/fp4_gpu.py --dry-run with Triton installed); its GPU timing is benchmarks/fp4_gpu.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N, BLOCK_K = 64, 128  # BLOCK_K a multiple of both groups (16, 32)


@triton.jit
def _pow2(exponent):
    """2^exponent (int32, -126..127) as float32, built from its bits."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(code):
    """code int32 0..15 (bit 3 sign, bits 2-1 exponent, bit 0 mantissa) -> float32 value."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    magnitude = tl.where(e == 0, 0.5 * m, (2.0 + m) * _pow2(e - 2))
    return tl.where(((code >> 3) & 1) == 1, -magnitude, magnitude)


@triton.jit
def _scale(bits, E8M0: tl.constexpr):
    """bits int32 0..255 -> float32: E8M0 2^(bits - 127), or FP8-E4M3 (sign, 4 exponent bits bias 7, 3 mantissa)."""
    if E8M0:
        value = tl.where(bits == 0, 1 << 22, bits << 23).to(tl.float32, bitcast=True)  # 0: 2^-127, subnormal
    else:
        e = (bits >> 3) & 15
        m = (bits & 7).to(tl.float32)
        magnitude = tl.where(e == 0, m * 0.001953125, (8.0 + m) * _pow2(e - 10))  # subnormal: m * 2^-9
        value = tl.where(((bits >> 7) & 1) == 1, -magnitude, magnitude)
    return value


@triton.jit
def _skinny_kernel(x_ptr, codes_ptr, scales_ptr, global_ptr, out_ptr, M, N, K, K_PER_SPLIT,
                   stride_xm, stride_cn, stride_sn, stride_os, stride_om,
                   GROUP: tl.constexpr, E8M0: tl.constexpr, HAS_GLOBAL: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        codes = tl.load(codes_ptr + offs_n[:, None] * stride_cn + offs_b[None, :],
                        mask=(offs_n[:, None] < N) & (offs_b[None, :] < K // 2), other=0).to(tl.int32)
        w = tl.reshape(tl.join(_e2m1(codes & 15), _e2m1(codes >> 4)), (BLOCK_N, BLOCK_K))  # low nibble first
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        bits = tl.load(scales_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
                       mask=(offs_n[:, None] < N) & (offs_g[None, :] < K // GROUP), other=0).to(tl.int32)
        w = tl.reshape(w, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * _scale(bits, E8M0)[:, :, None]  # exact
        if HAS_GLOBAL:
            w = w * tl.load(global_ptr)
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def split_k(n: int, k: int, num_sms: int) -> int:
    """Programs per column block along K: doubled while the grid has fewer than two programs per SM and
    each split keeps at least one BLOCK_K step (from the weight's shape and the GPU only)."""
    n_blocks, k_blocks, split = triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K), 1
    while split * 2 <= k_blocks and n_blocks * split < 2 * num_sms:
        split *= 2
    return split


def skinny_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None,
                  bias: torch.Tensor | None, group: int, num_sms: int | None = None) -> torch.Tensor:
    """x [M, K] (M small) @ the 4-bit weight [N, K]^T (+ bias) -> [M, N] in x's dtype."""
    x = x.contiguous()
    (M, K), N = x.shape, codes.shape[0]
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    split = split_k(N, K, num_sms)
    per_split = triton.cdiv(triton.cdiv(K, BLOCK_K), split) * BLOCK_K
    block_m = max(16, triton.next_power_of_2(M))
    partial = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, BLOCK_N), split, triton.cdiv(M, block_m))
    _skinny_kernel[grid](x, codes, scales, codes if global_scale is None else global_scale, partial, M, N, K, per_split,
                         x.stride(0), codes.stride(0), scales.stride(0), partial.stride(0), partial.stride(1),
                         GROUP=group, E8M0=group == 32, HAS_GLOBAL=global_scale is not None,
                         IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    out = partial.sum(0) if split > 1 else partial[0]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
