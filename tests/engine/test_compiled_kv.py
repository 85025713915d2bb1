"""The step at the memory roofline, proven on CPU (issue: the GPU step).

(a) the compiled decode and verification forwards write the KV pool in place: inductor's generated
    code allocates no buffer the size of a layer's pool and scatters or copies nothing into it;
(c) the eager decode forward stays within a budget of kernels per layer (counted at the ATen level,
    where each op is one kernel launch on CUDA), views apart;
(d) the memory a step allocates does not grow with the pool.
(b), compiled greedy output equal to eager's for every method, is in tests/engine/test_compiled_step.py.
"""

from __future__ import annotations

import collections
import math
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rayspec.cpu import kernels as cpu_kernels
from rayspec.model.batch_layout import TreeQuery
from rayspec.model.families import ModelArgs
from rayspec.model.kv_cache import ForwardBatch, KVCache
from rayspec.model.linear import Linear
from rayspec.model.native import MLP, Attention, CausalLM
from rayspec.model.runner import ModelRunner, make_runner

HEAD_DIM = 16


def tiny_model(num_layers: int, device_path: bool = False) -> CausalLM:
    """A random 4-head / 2-KV-head model. device_path: the op path a GPU takes (q/k/v and gate/up as
    one matmul each, every Linear through F.linear), on CPU."""
    args = ModelArgs(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=num_layers, num_heads=4,
                     num_kv_heads=2, head_dim=HEAD_DIM, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = CausalLM(args, 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))).eval()
    if device_path:
        kernels = cpu_kernels.CpuKernels.single("flinear", "test")
        for module in model.modules():
            if isinstance(module, Linear):
                module.kernels = kernels
            if isinstance(module, (Attention, MLP)):
                module.fuse_for_device()
    return model


def _runner(model, num_blocks: int, context: int, compile: bool) -> ModelRunner:
    runner = make_runner(model, max_model_len=context + 64, num_slots=2, slack=0, num_blocks=num_blocks,
                         compile=compile)
    runner.kv.allocate("s")
    with torch.inference_mode():
        runner.forward_hidden(["s"], [[(7 * i) % 250 + 3 for i in range(context)]])
    return runner


def _generated_code(fn):
    """(fn's result, inductor's code for it)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()  # compile now, whatever earlier tests compiled
    with torch.inference_mode():
        result, codes = run_and_get_code(fn)
    assert codes, "nothing was compiled"
    return result, "\n".join(codes)


def _numel(shape: str, symbols: int) -> int:
    dims = [d.strip() for d in shape.split(",") if d.strip()]
    # a symbolic size (the keys, marked dynamic) is taken at its largest here: the pool's row count
    return math.prod(int(d) if d.isdigit() else symbols for d in dims)


@pytest.mark.parametrize("case", ["decode", "chain verification", "tree verification"])
def test_compiled_step_writes_the_pool_in_place(case):
    """Inductor's code for the step: every layer's K and V pool is a graph input written by a kernel
    in place; no buffer as large as a layer's pool is allocated, nothing is scattered or copied back
    into a pool. (Failed with the pool as one [layers, rows, ...] tensor: each layer's write became a
    copy of its slice plus a select_scatter into the whole pool.)"""
    layers, context = 3, 40
    model = tiny_model(layers)
    runner = _runner(model, num_blocks=256, context=context, compile=True)
    pool_rows, kv_heads = runner.cache.k[0].shape[:2]
    pool_numel = runner.cache.k[0].numel()

    def step(runner=runner):
        runner.kv.set_cached_len("s", context)
        if case == "decode":
            return runner.forward_hidden(["s"], [[5]], packed=True, static=True)[0]
        if case == "chain verification":
            return runner.forward_hidden(["s"], [[5, 6, 7, 8]], packed=True, static=True)[0]
        tree = TreeQuery(parents=[-1, 0, 0, 1, 2, 3, -1])
        return runner.forward_hidden(["s"], [[5, 6, 7, 8, 9, 10, 11]], trees=[tree], packed=True, static=True)[0]

    compiled, code = _generated_code(step)
    # and inductor's kernels compute what the eager step computes (the engines' greedy outputs through
    # inductor: tests/engine/test_compiled_step.py, decode; this is where a tree's verification is checked)
    with torch.inference_mode():
        eager = step(_runner(model, num_blocks=256, context=context, compile=False))
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    # the pool inputs: a layer's [rows, kv_heads, head_dim], or (one tensor for all) [layers, rows, ...]
    pools = set(re.findall(rf"assert_size_stride\((\w+), \((?:{layers}, )?{pool_rows}, {kv_heads}, {HEAD_DIM}\)", code))
    assert pools
    allocations = re.findall(r"empty_strided_\w+\(\(([^()]*)\)", code)
    assert allocations
    too_big = [shape for shape in allocations if _numel(shape, context + 64) * 4 >= pool_numel]
    assert not too_big, f"buffers of a pool's size: {too_big}"
    assert "scatter" not in code, "a scatter into the pool"
    for pool in pools:
        assert not re.search(rf"\b{pool}\.copy_\(|copy_\([^)]*\b{pool}\b", code), f"{pool} copied into"
        calls = [line for line in code.splitlines() if re.search(rf"\b{pool}\b", line) and "(" in line
                 and not line.strip().startswith(("assert_size_stride", "del ", "#")) and "rand_strided" not in line]
        assert calls, f"{pool} is never written by a kernel"
    assert len(pools) == 2 * layers, (pools, "each layer's K and V: a graph input of its own")


class KernelCount(TorchDispatchMode):
    """Counts the ATen ops a forward dispatches that are not views (each one kernel launch on CUDA)."""

    def __init__(self):
        super().__init__()
        self.kernels: collections.Counter = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view or func is torch.ops.aten.detach.default:
            self.views += 1
        else:
            self.kernels[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _decode_kernels(num_layers: int, batch_size: int, kv_len: int = 40) -> KernelCount:
    model = tiny_model(num_layers, device_path=True)
    cache = KVCache(model.args, 16, 16, torch.float32, "cpu")
    read = torch.arange(kv_len)[None] + torch.arange(batch_size)[:, None] * 64  # [B, kv_len] pool rows
    batch = ForwardBatch(write_index=read[:, -1:], read_index=read, positions=torch.full((batch_size, 1), kv_len - 1),
                         kv_len=kv_len, mask=None if batch_size == 1 else torch.zeros(batch_size, 1, 1, kv_len),
                         read_range=(0, kv_len) if batch_size == 1 else None)
    ids = torch.full((batch_size, 1), 5)
    with torch.inference_mode():
        model(ids, cache, batch)
        with KernelCount() as count:
            model(ids, cache, batch)
    return count


# kernels per decoder layer of the eager decode forward, GPU op path: 2 RMSNorms, 4 matmuls (q/k/v
# fused, o, gate/up fused, down), rotary of q and k together (mul, roll, addcmul), the K and V writes,
# SDPA, silu, the MLP's product, 2 residual adds = 16; at batch > 1 the keys and values are gathered
# through the block tables (2 more). It was 23 (rotary alone 10: mul/neg/cat/mul/add for q and k).
KERNELS_PER_LAYER = {1: 16, 4: 18}


@pytest.mark.parametrize("batch_size", [1, 4])
def test_decode_kernels_per_layer_within_budget(batch_size):
    two, four = _decode_kernels(2, batch_size), _decode_kernels(4, batch_size)
    per_layer = (sum(four.kernels.values()) - sum(two.kernels.values())) / 2
    which = {k: (four.kernels[k] - two.kernels[k]) // 2 for k in four.kernels if four.kernels[k] != two.kernels[k]}
    assert per_layer <= KERNELS_PER_LAYER[batch_size], which
    assert which.get("roll") == 1 and which.get("addcmul") == 1, which  # q and k rotated at once
    assert (four.views - two.views) / 2 <= 24


class Allocations(TorchDispatchMode):
    """The bytes of every tensor an op returns (its allocations; views and in-place ops return none)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.sizes.append(t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("batch_size", [1, 3])
def test_eager_step_allocates_nothing_that_grows_with_the_pool(batch_size):
    """The same decode step over a pool 16x larger allocates the same bytes, none of them near a
    pool's size (a write into the pool is in place; keys are read by the block tables' rows)."""
    model = tiny_model(2)
    totals = []
    for num_blocks in (32, 512):
        runner = make_runner(model, max_model_len=128, num_slots=batch_size, slack=0, num_blocks=num_blocks)
        ids = [f"s{b}" for b in range(batch_size)]
        with torch.inference_mode():
            for b, s in enumerate(ids):
                runner.kv.allocate(s)
                runner.forward_hidden([s], [[(3 * i + b) % 250 + 3 for i in range(30 + b)]])
            with Allocations() as alloc:
                runner.forward_hidden(ids, [[5]] * batch_size, packed=True, static=True)
        totals.append(sum(alloc.sizes))
        assert max(alloc.sizes) * 4 < runner.cache.k[0].numel() * runner.cache.k[0].element_size()
    assert totals[0] == totals[1], totals
