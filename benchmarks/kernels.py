"""Triton kernel benchmark (GPU): fp8 KV-cache quantization, compile counts, dynamic lengths.

    python -m benchmarks.kernels            # about 2-4 minutes on an H200
    python -m benchmarks.kernels --no-tune  # without the store-kernel tile sweep
    python -m benchmarks.kernels --only-gdn-prefill  # just the GDN prefill timing
    python -m benchmarks.kernels --only-v4-topk      # the V4 indexer's top-k select geometry
    python -m benchmarks.kernels --only-v4-mhc       # the V4 mHC pre's two launches
    python -m benchmarks.kernels --only-moe-align    # the MoE align's geometry
    python -m benchmarks.kernels --only-moe-gemv     # MoE decode: per-pair GEMV vs grouped
    python -m benchmarks.kernels --only-v4-decode    # V4 decode attention's launch geometry
    python -m benchmarks.kernels --only-v4-decode --short  # its per-case default against 5 others

One JSON line per measurement, on stdout:

- ``copy``: device-to-device ``copy_`` bandwidth, (read + write bytes) / time, of a 2 GiB
  buffer (HBM) and of buffers as large as each KV-store case (``hot``: repeated on the same
  data, so what fits the 50 MB L2 partly stays there, as it does for the store kernel).
- ``kv_store``: ``store_kvcache`` of T tokens x 12 kv heads x head_dim 128 from bf16 K/V
  into an fp8 cache (``fp8``: quantize, write rows and scales) or a bf16 one (``auto``:
  copy), T in 257, 4096, 65536, 1,048,576; device microseconds per launch and achieved GB/s
  (bytes read + written), beside the copy bandwidth of the same bytes and of HBM.
  ``cold`` figures flush L2 (a 256 MiB memset) before each launch and subtract the flush.
- ``kv_store_tile``: the same at 4096 and 65536 tokens for other (BLOCK_R, num_warps).
- ``compile``: variants compiled and seconds spent compiling over the lengths
  1, 16, 257, 4096, 4097, 65536, per kernel, ``default`` (a copy of the kernel without
  do_not_specialize: ``triton.jit(kernel.fn)``) vs ``dynamic`` (atom's), each with an empty
  Triton cache directory.
- ``dynamic_vs_specialized``: device time of the dynamic kernel against the default copy,
  specialized for a length that is a multiple of 16 (4096 and 65536).

- ``v4_topk``: `v4_topk.indexer_topk_select` (top-512 of each row's visible scores) at 1
  and 64 rows, 2,048 and 16,384 visible entries (8K and 64K tokens at ratio 4), per
  (chunk, num_warps), each checked equal to the reference (the single-program kernel).
- ``v4_topk_split``: the single-program select against the split one (`topk_splits`'
  choice and forced split counts, chunk 2048/8 warps and 1024/4) at 1 and 64 rows and
  2K / 16K / 64K visible entries; ``ratio`` = split / single.
- ``v4_mhc``: `v4_mhc.hc_pre` at V4's shape (4 streams of 4,096, 20 Sinkhorn iterations)
  for 1 and 64 tokens: the mix GEMV per split count and the finish per warp count (and with
  one Sinkhorn iteration, to show its share).
- ``gdn_prefill`` / ``gdn_prefill_tile``: the GDN delta rule's prefill, chunked kernels vs
  the sequential kernel vs the torch reference (benchmarks/gdn_prefill.py).
- ``moe_gemv``: `moe.fused_moe`'s routed experts (no shared expert, the sum over k
  included) at Qwen3-Next's (64 experts of 512, top-10, hidden 2048) and DeepSeek-V4's
  (16 of 2048, top-6, hidden 4096) bf16 shapes, 1, 2, 4 and 6 tokens: the grouped path
  (align + grouped GEMMs) and the per-pair GEMV with `moe_gemv.gemv_tiles`' tiles
  (``default``) and other (gate_up, down) tiles (`moe_gemv.TILES_OVERRIDE`); ``cold``: L2
  flushed before each call (a decode step reads each layer's experts once). ``gb_s``: the
  distinct experts' weight bytes / cold time; ``max_gap``: against the grouped path.
- ``v4_decode``: `v4_attention.v4_decode_attention` at V4's shape (64 heads of 512, bf16,
  window 128, block size 16) and an 8K context, 1 and 64 rows: CSA (ratio 4, 512 chosen
  entries) and HCA (ratio 128, every visible entry), per (BLOCK_H, BLOCK_N, num_warps,
  num_stages) and split count (auto, 2), each checked against the reference; ``gb_s``: the
  distinct key bytes read (window + entries, once per row) / time. A geometry Triton cannot
  fit is skipped with its error. ``--short``: the default (the per-case choice,
  `v4_attention.decode_geometry`, its resolution in ``chosen``) against the module's
  geometry and four others, automatic splits, 1 / 8 / 32 / 64 rows at 8K and 64K.

Timing: CUDA events around a CUDA graph of 20 launches (no host launch overhead), median of
15 replays after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from atom.kernels import activation, decode_attention, kv_cache, prefill_attention, rmsnorm, rotary
from atom.kernels.jit_variants import compiled_variants, swapped_kernels
from benchmarks.gdn_prefill import bench_gdn_prefill
from benchmarks.harness import device_us, emit

LENGTHS = [1, 16, 257, 4096, 4097, 65536]
KV_TOKENS = [257, 4096, 65536, 1 << 20]
NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 128, 16
DEVICE = "cuda"
BF16 = torch.bfloat16


# -- timing ------------------------------------------------------------------------------------


def copy_gbps(nbytes: int) -> float:
    """(read + write) GB/s of ``dst.copy_(src)`` for ``nbytes``-byte buffers."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    us = device_us(lambda: dst.copy_(src), launches=10 if nbytes >= 1 << 30 else 20)
    return 2 * nbytes / us / 1e3


# -- KV-cache store ---------------------------------------------------------------------------


def kv_store_case(num_tokens: int, kv_cache_dtype: str):
    """Inputs of one store: bf16 K/V, a cache of shuffled blocks, slots block by block."""
    generator = torch.Generator(DEVICE).manual_seed(num_tokens)
    shape = (num_tokens, NUM_KV_HEADS, HEAD_DIM)
    key = torch.randn(shape, device=DEVICE, dtype=BF16, generator=generator)
    value = torch.randn(shape, device=DEVICE, dtype=BF16, generator=generator)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    blocks = torch.randperm(num_blocks, device=DEVICE, generator=generator)
    tokens = torch.arange(num_tokens, device=DEVICE)
    slots = blocks[tokens // BLOCK_SIZE] * BLOCK_SIZE + tokens % BLOCK_SIZE
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    fp8 = kv_cache_dtype == "fp8"
    cache_dtype = kv_cache.FP8_DTYPE if fp8 else BF16
    k_cache = torch.zeros(cache_shape, device=DEVICE, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    scales = [torch.zeros(cache_shape[:3], device=DEVICE) for _ in range(2)] if fp8 else [None] * 2
    elements = num_tokens * NUM_KV_HEADS * HEAD_DIM
    read = 2 * elements * 2 + num_tokens * 8  # K, V and the slot mapping
    written = 2 * elements * cache_dtype.itemsize + (
        2 * num_tokens * NUM_KV_HEADS * 4 if fp8 else 0
    )
    return (key, value, k_cache, v_cache, slots, *scales), read + written


def store_call(args) -> Callable[[], None]:
    key, value, k_cache, v_cache, slots, k_scale, v_scale = args
    return lambda: kv_cache.store_kvcache(
        key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale
    )


def bench_kv_store(hbm_gbps: float, tune: bool) -> None:
    flush_buffer = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    for num_tokens in KV_TOKENS:
        same_bytes_gbps = None
        for kv_cache_dtype in ("fp8", "auto"):
            args, nbytes = kv_store_case(num_tokens, kv_cache_dtype)
            us = device_us(store_call(args))
            cold_us = device_us(store_call(args), flush=flush_buffer.zero_)
            if same_bytes_gbps is None:
                same_bytes_gbps = copy_gbps(nbytes // 2)  # a copy reads and writes its size
            gbps = nbytes / us / 1e3
            emit(
                bench="kv_store",
                kv_cache_dtype=kv_cache_dtype,
                tokens=num_tokens,
                kv_heads=NUM_KV_HEADS,
                head_dim=HEAD_DIM,
                bytes=nbytes,
                us=round(us, 2),
                gbps=round(gbps, 1),
                cold_us=round(cold_us, 2),
                cold_gbps=round(nbytes / cold_us / 1e3, 1),
                copy_same_bytes_gbps=round(same_bytes_gbps, 1),
                copy_hbm_gbps=round(hbm_gbps, 1),
                fraction_of_same_bytes_copy=round(gbps / same_bytes_gbps, 3),
                fraction_of_hbm_copy=round(gbps / hbm_gbps, 3),
            )
            if tune and kv_cache_dtype == "fp8" and num_tokens in (4096, 65536):
                bench_store_tiles(args, nbytes, num_tokens)
            del args
            torch.cuda.empty_cache()


def bench_store_tiles(args, nbytes: int, num_tokens: int) -> None:
    default = kv_cache.store_config(NUM_KV_HEADS, HEAD_DIM)
    for block_r in (8, 16, 32, 64):
        for num_warps in (2, 4, 8):
            tile = (block_r, num_warps)
            us = device_us(lambda tile=tile: kv_cache.launch_store_kernel(*args, *tile))
            emit(
                bench="kv_store_tile",
                tokens=num_tokens,
                block_r=block_r,
                num_warps=num_warps,
                default=tile == default,
                us=round(us, 2),
                gbps=round(nbytes / us / 1e3, 1),
            )


# -- compile counts and dynamic vs specialized ------------------------------------------------


def kernel_cases() -> dict[str, tuple[object, list[str], Callable[[int], None]]]:
    """name -> (module, kernel names, run(n)) over the public wrappers, lengths up to 65536."""
    longest = max(LENGTHS)
    x = torch.randn(longest, 4096, device=DEVICE, dtype=BF16)
    weight = torch.ones(2048, device=DEVICE, dtype=BF16)
    qkv = torch.randn(longest, 48, 64, device=DEVICE, dtype=BF16)  # 32 q + 8 k + 8 v heads
    cos = torch.rand(8192, 64, device=DEVICE)
    positions = torch.randint(0, 8192, (longest,), device=DEVICE)
    kv_args = {}
    for kv_cache_dtype in ("auto", "fp8"):
        args, _ = kv_store_case(longest, kv_cache_dtype)
        kv_args[kv_cache_dtype] = args
    # Attention: 32 q / 8 kv heads, head_dim 128, 2048 cache blocks read through random tables.
    k_cache = torch.randn(2048, BLOCK_SIZE, 8, 128, device=DEVICE, dtype=BF16)
    q = torch.randn(longest + 1, 32, 128, device=DEVICE, dtype=BF16)

    def tables(rows, context):
        return torch.randint(0, 2048, (rows, -(-context // BLOCK_SIZE) + 1), device=DEVICE).int()

    def store(kv_cache_dtype):
        key, value, k, v, slots, k_scale, v_scale = kv_args[kv_cache_dtype]
        return lambda n: kv_cache.store_kvcache(
            key[:n], value[:n], k, v, slots[:n], k_scale=k_scale, v_scale=v_scale
        )

    def decode(n):
        lens = torch.tensor([n, n // 2 + 1, 1], device=DEVICE, dtype=torch.int32)
        decode_attention.paged_decode_attention(q[:3], k_cache, k_cache, tables(3, n), lens, 0.088)
        lens = torch.randint(1, 65, (n,), device=DEVICE, dtype=torch.int32)
        decode_attention.paged_decode_attention(q[:n], k_cache, k_cache, tables(n, 64), lens, 0.088)

    def prefill(n):
        q_lens = [min(2048, n - start) for start in range(0, n, 2048)] + [1]
        cu_seqlens = torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).int()
        lens = torch.tensor(q_lens, device=DEVICE, dtype=torch.int32) + 16
        block_tables = tables(len(q_lens), max(q_lens) + 16)
        prefill_attention.paged_prefill_attention(
            q[: n + 1], k_cache, k_cache, block_tables, cu_seqlens, lens, 0.088, max(q_lens)
        )

    return {
        "silu_and_mul": (
            activation,
            ["_silu_and_mul_kernel"],
            lambda n: activation.silu_and_mul(x[:n]),
        ),
        "rms_norm": (
            rmsnorm,
            ["_rms_norm_kernel"],
            lambda n: rmsnorm.rms_norm(x[:n, :2048], weight, 1e-6, x[:n, 2048:]),
        ),
        "rotary": (
            rotary,
            ["_rotary_kernel"],
            lambda n: rotary.apply_rotary(positions[:n], qkv[:n, :32], qkv[:n, 32:40], cos, cos),
        ),
        "store_kvcache_bf16": (kv_cache, ["_store_kvcache_kernel"], store("auto")),
        "store_kvcache_fp8": (kv_cache, ["_store_kvcache_kernel"], store("fp8")),
        "paged_decode": (
            decode_attention,
            ["_paged_decode_kernel", "_merge_splits_kernel"],
            decode,
        ),
        "paged_prefill": (prefill_attention, ["_paged_prefill_kernel"], prefill),
    }


def fresh_triton_cache() -> str:
    """Point Triton at an empty cache directory, so the next compilations really compile."""
    path = tempfile.mkdtemp(prefix="atom-triton-cache-")
    os.environ["TRITON_CACHE_DIR"] = path
    try:
        import triton

        triton.knobs.cache.dir = path  # Triton >= 3.4 reads its knobs
    except (ImportError, AttributeError):
        pass
    return path


def bench_compile(cases) -> None:
    for name, (module, names, run) in cases.items():
        for mode in ("default", "dynamic"):
            fresh_triton_cache()
            with swapped_kernels(module, names, dynamic=mode == "dynamic") as copies:
                torch.cuda.synchronize()
                start = time.perf_counter()
                for n in LENGTHS:
                    run(n)
                torch.cuda.synchronize()
                cold = time.perf_counter() - start
                start = time.perf_counter()
                for n in LENGTHS:  # everything compiled now: the same work without compiling
                    run(n)
                torch.cuda.synchronize()
                warm = time.perf_counter() - start
                variants = {k: compiled_variants(copy) for k, copy in copies.items()}
            emit(
                bench="compile",
                kernel=name,
                mode=mode,
                lengths=LENGTHS,
                variants=sum(variants.values()),
                variants_per_kernel=variants,
                compile_s=round(cold - warm, 3),
            )


def bench_dynamic_vs_specialized(cases) -> None:
    for name in ("silu_and_mul", "rms_norm", "rotary", "store_kvcache_bf16", "store_kvcache_fp8"):
        module, names, run = cases[name]
        for n in (4096, 65536):
            us = {}
            for mode in ("dynamic", "default"):
                with swapped_kernels(module, names, dynamic=mode == "dynamic"):
                    us[mode] = device_us(lambda run=run, n=n: run(n))
            emit(
                bench="dynamic_vs_specialized",
                kernel=name,
                n=n,
                dynamic_us=round(us["dynamic"], 2),
                specialized_us=round(us["default"], 2),
                ratio=round(us["dynamic"] / us["default"], 3),
            )


def bench_v4_topk() -> None:
    from atom.kernels import v4_topk

    for rows, visible in ((1, 2048), (1, 16384), (64, 2048), (64, 16384)):
        generator = torch.Generator("cuda").manual_seed(rows + visible)
        scores = torch.randn(rows, 4 * visible, device="cuda", generator=generator)
        scores = scores.relu()  # the indexer's ReLU: many exact ties at 0
        counts = torch.full((rows,), visible, device="cuda", dtype=torch.int64)
        expected = v4_topk.indexer_topk_select_reference(scores, counts, 512)
        for chunk in (1024, 2048, 4096):
            for warps in (4, 8, 16):

                def run(chunk=chunk, warps=warps, scores=scores, counts=counts):
                    return v4_topk.indexer_topk_select(
                        scores, counts, 512, chunk=chunk, num_warps=warps, num_splits=1
                    )

                equal = bool(torch.equal(run(), expected))
                emit(bench="v4_topk", rows=rows, visible=visible, chunk=chunk,
                     num_warps=warps, us=round(device_us(run), 2), equal=equal)  # fmt: skip
    bench_v4_topk_split()


def bench_v4_topk_split() -> None:
    """``v4_topk_split``: the single-program select against the split one (S programs a
    row; ``auto``: `topk_splits`' choice, then forced counts) at 1 and 64 rows, 2K / 16K /
    64K visible entries, the scores row as wide as the visible entries and 4 times wider
    (`topk_splits` reads the width), top-512; ``ratio``: split / single time."""
    from atom.kernels import v4_topk
    from atom.kernels.decode_attention import multi_processors

    sms = multi_processors(torch.device("cuda"))
    for rows in (1, 64):
        for visible in (2048, 16384, 65536):
            for width in (visible, 4 * visible):
                generator = torch.Generator("cuda").manual_seed(rows + width)
                scores = torch.randn(rows, width, device="cuda", generator=generator).relu()
                counts = torch.full((rows,), visible, device="cuda", dtype=torch.int64)
                expected = v4_topk.indexer_topk_select_reference(scores, counts, 512)
                single = device_us(lambda s=scores, c=counts: v4_topk.indexer_topk_select(
                    s, c, 512, num_splits=1))  # fmt: skip
                auto = v4_topk.topk_splits(rows, width, sms)
                emit(bench="v4_topk_split", rows=rows, visible=visible, width=width,
                     splits=1, auto=auto, single_us=round(single, 2))  # fmt: skip
                forced = [2, 4, 8, 16, 32, 64, 128] if rows == 1 else [2, 3, 4, 8]
                for splits in sorted({auto, *forced} - {1}):
                    for chunk, warps in ((2048, 8), (1024, 4)):

                        def run(s=scores, c=counts, n=splits, chunk=chunk, warps=warps):
                            return v4_topk.indexer_topk_select_split(
                                s, c, 512, None, n, chunk=chunk, num_warps=warps
                            )

                        us = device_us(run)
                        emit(bench="v4_topk_split", rows=rows, visible=visible, width=width,
                             splits=splits, auto=auto, chunk=chunk, num_warps=warps,
                             us=round(us, 2), ratio=round(us / single, 3),
                             equal=bool(torch.equal(run(), expected)))  # fmt: skip


def bench_v4_mhc() -> None:
    from atom.kernels import v4_mhc

    n, d, iters = 4, 4096, 20
    m = (2 + n) * n
    generator = torch.Generator("cuda").manual_seed(0)
    fn = torch.randn(m, n * d, device="cuda", generator=generator) * 0.01
    base = torch.randn(m, device="cuda", generator=generator)
    scale = torch.rand(3, device="cuda", generator=generator)
    norm_weight = torch.rand(d, device="cuda", generator=generator) + 0.5
    defaults = (v4_mhc.MAX_SPLITS, v4_mhc.FINISH_WARPS)
    try:
        for tokens in (1, 64):
            streams = torch.randn(tokens, n, d, device="cuda", dtype=torch.bfloat16)
            expected = v4_mhc.hc_pre_reference(
                streams, fn, base, scale, norm_weight, iters, 1e-6, 1e-6, 1e-6
            )
            for splits in (16, 32, 64, 128):
                v4_mhc.MAX_SPLITS = splits
                us = device_us(lambda streams=streams: v4_mhc._mix_partials(streams, fn))
                emit(bench="v4_mhc_mix", tokens=tokens, max_splits=splits, us=round(us, 2))
            v4_mhc.MAX_SPLITS = defaults[0]
            partial, used = v4_mhc._mix_partials(streams, fn)
            for warps in (None, 1, 2, 4, 8, 16):
                v4_mhc.FINISH_WARPS = warps
                for loops in (iters, 1):

                    def finish(loops=loops, streams=streams, partial=partial, used=used):
                        return v4_mhc._finish(streams, partial, used, base, scale, norm_weight,
                                              1e-6, 1e-6, 1e-6, loops, head=False)  # fmt: skip

                    gap = max((a.float() - b.float()).abs().max().item()
                              for a, b in zip(finish(), expected, strict=True))  # fmt: skip
                    emit(bench="v4_mhc_finish", tokens=tokens,
                         num_warps=warps or "default", iters=loops,
                         us=round(device_us(finish), 2),
                         max_gap=round(gap, 5) if loops == iters else None)  # fmt: skip
    finally:
        v4_mhc.MAX_SPLITS, v4_mhc.FINISH_WARPS = defaults


def bench_moe_align() -> None:
    """`moe.moe_align` per (one-hot entries per step, warps) at the decode pair counts of
    DeepSeek-V4 (16 experts, top-6) and Qwen3-Next (64 experts, top-10), batch 1 and 64."""
    from atom.kernels import moe

    try:
        for experts, top_k in ((16, 6), (64, 10)):
            for tokens in (1, 64):
                generator = torch.Generator("cuda").manual_seed(tokens)
                scores = torch.rand(tokens, experts, device="cuda", generator=generator)
                ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
                block_m = 16
                expected = moe.moe_align_reference(ids, experts, block_m)
                for one_hot in (1024, 4096, 16384):
                    for warps in (1, 4, 8, 16):
                        moe.ALIGN_OVERRIDE = (one_hot, warps)

                        def run(ids=ids, experts=experts, block_m=block_m):
                            return moe.moe_align(ids, experts, block_m)

                        same = all(torch.equal(a, b) for a, b in zip(run(), expected, strict=True))
                        emit(bench="moe_align", experts=experts, pairs=tokens * top_k,
                             one_hot=one_hot, num_warps=warps, us=round(device_us(run), 2),
                             equal=same)  # fmt: skip
    finally:
        moe.ALIGN_OVERRIDE = None


def bench_moe_gemv() -> None:
    """The MoE decode paths at Qwen3-Next's and DeepSeek-V4's shapes (see the module doc)."""
    from atom.kernels import moe, moe_gemv

    Tiles = moe_gemv.MoeGemvTiles
    candidates = [None]  # None: gemv_tiles' choice
    for gate_up_n, down_n in ((4, 8), (4, 16), (8, 16), (16, 16)):
        for block_k in (256, 512, 1024):
            for stages in (1, 2):
                candidates.append(
                    (Tiles(gate_up_n, block_k, 4, stages), Tiles(down_n, block_k, 4, stages))
                )
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda").zero_
    try:
        for name, experts, top_k, hidden, inter in (("qwen3-next", 64, 10, 2048, 512),
                                                    ("deepseek-v4", 16, 6, 4096, 2048)):  # fmt: skip
            generator = torch.Generator("cuda").manual_seed(0)
            gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=generator)
            down = torch.randn(experts, hidden, inter, device="cuda", generator=generator)
            gate_up, down = (gate_up * hidden**-0.5).bfloat16(), (down * inter**-0.5).bfloat16()
            for tokens in (1, 2, 4, 6):
                scores = torch.rand(tokens, experts, device="cuda", generator=generator)
                weights, ids = scores.topk(top_k, dim=-1)
                x = torch.randn(tokens, hidden, device="cuda", generator=generator).bfloat16()
                hit = ids.unique().numel()
                weight_bytes = hit * 3 * inter * hidden * 2

                def run(x=x, weights=weights, ids=ids, gate_up=gate_up, down=down):
                    return moe.fused_moe(x, weights, ids, gate_up, down)

                record = dict(bench="moe_gemv", model=name, tokens=tokens, pairs=tokens * top_k)
                moe.DECODE_GEMV_OVERRIDE = False
                grouped = run()
                for tiles in ["grouped", *candidates]:
                    moe.DECODE_GEMV_OVERRIDE = tiles != "grouped"
                    moe_gemv.TILES_OVERRIDE = None if tiles in ("grouped", None) else tiles
                    gap = (run().float() - grouped.float()).abs().max().item()
                    cold = device_us(run, flush=flush)
                    label = {"grouped": "grouped", None: "default"}.get(tiles)
                    emit(record, path="grouped" if tiles == "grouped" else "gemv",
                         tiles=label or [vars(t) for t in tiles], us=round(device_us(run), 2),
                         cold_us=round(cold, 2), gb_s=round(weight_bytes / cold / 1e3, 1),
                         max_gap=round(gap, 5))  # fmt: skip
    finally:
        moe.DECODE_GEMV_OVERRIDE, moe_gemv.TILES_OVERRIDE = None, None


def v4_decode_case(rows: int, ratio: int, chosen: int, context: int = 8192):
    """`v4_decode_attention`'s arguments at V4's shape (as tests/kernels/test_v4_kernels.py's
    case, every row at `context` tokens, none padded) and the key bytes a call reads."""
    from atom.kernels.v4_compressor import pool_layout

    heads, dim, window, block_size = 64, 512, 128, 16
    generator = torch.Generator("cuda").manual_seed(rows + ratio)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=generator).to(BF16)

    positions = torch.full((rows,), context - 1, device="cuda")
    width = context // block_size + 1
    tables = torch.randperm(rows * width, device="cuda", generator=generator).view(rows, width)
    visible = context // ratio
    entries = min(chosen, visible) if chosen else visible
    if chosen:
        ids = torch.rand(rows, visible, device="cuda", generator=generator).topk(chosen).indices
        ids = ids.sort(dim=-1).values
    else:
        ids = None
    args = (
        randn(rows, heads, dim),
        randn(rows + 1, window, dim),
        torch.arange(rows, device="cuda", dtype=torch.int32),
        positions,
        torch.full((rows,), context, device="cuda", dtype=torch.int32),
        randn(rows * width + 1, *pool_layout(block_size, ratio, dim)),
        ids,
        tables.int(),
        ratio,
        block_size,
        torch.randn(heads, device="cuda", generator=generator),
    )
    return args, rows * (window + entries) * dim * 2


def bench_v4_decode(short: bool = False) -> None:
    """V4 decode attention's launch geometry (see the module doc); ``short``: the default
    against a few candidates, automatic splits, at 8K and 64K."""
    from atom.kernels import v4_attention

    default = (None, None, None, None)  # the per-case choice (`decode_geometry`)
    module = (v4_attention.BLOCK_H, v4_attention.BLOCK_N, v4_attention.NUM_WARPS,
              v4_attention.NUM_STAGES)  # fmt: skip
    geometries = [default, module, (16, 16, 4, 3), (16, 16, 8, 2), (16, 32, 8, 2),
                  (16, 32, 4, 3)]  # fmt: skip
    if not short:
        for block_h in (16, 32, 64):
            for block_n in (32, 64):
                for warps in (4, 8):
                    for stages in (2, 3):
                        geometries.append((block_h, block_n, warps, stages))
    geometries = list(dict.fromkeys(geometries))
    scale = 512**-0.5
    for context in (8192, 65536) if short else (8192,):
        for rows in (1, 8, 32, 64) if short else (1, 64):
            for name, ratio, chosen in (("csa", 4, 512), ("hca", 128, 0)):
                args, key_bytes = v4_decode_case(rows, ratio, chosen, context)
                expected = v4_attention.v4_decode_attention_reference(*args, scale=scale)
                expected = expected.float()
                tolerance = 2e-2 * expected.abs().max().item()
                for geometry in geometries:
                    for splits in (None,) if short else (None, 2):
                        record = dict(bench="v4_decode", kind=name, rows=rows, context=context,
                                      block_h=geometry[0], block_n=geometry[1],
                                      warps=geometry[2], stages=geometry[3],
                                      splits=splits or "auto", default=geometry == default)  # fmt: skip
                        if geometry == default:  # what the per-case choice resolved to
                            q = args[0]
                            record["chosen"] = v4_attention.decode_geometry(
                                chosen > 0,
                                splits or v4_attention.decode_splits(q, -(-q.shape[1] // v4_attention.BLOCK_H)),
                            )  # fmt: skip

                        def run(geometry=geometry, splits=splits, args=args):
                            h, n, w, st = geometry
                            return v4_attention.v4_decode_attention(
                                *args, scale=scale, num_splits=splits, block_h=h, block_n=n,
                                num_warps=w, num_stages=st,
                            )  # fmt: skip

                        try:
                            gap = (run().float() - expected).abs().max().item()
                            us = device_us(run)
                        except Exception as e:  # out of shared memory / registers
                            emit(record, error=f"{type(e).__name__}: {str(e)[:120]}")
                            continue
                        emit(record, us=round(us, 2), gb_s=round(key_bytes / us / 1e3, 1),
                             max_gap=round(gap, 4), ok=gap <= tolerance)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-tune", action="store_true", help="skip the store tile sweep")
    parser.add_argument("--only-gdn-prefill", action="store_true", help="the GDN prefill only")
    parser.add_argument("--only-v4-topk", action="store_true", help="the V4 top-k select only")
    parser.add_argument("--only-v4-mhc", action="store_true", help="the V4 mHC pre only")
    parser.add_argument("--only-moe-align", action="store_true", help="the MoE align only")
    parser.add_argument("--only-moe-gemv", action="store_true", help="the MoE decode paths")
    parser.add_argument("--only-v4-decode", action="store_true", help="V4 decode attention")
    parser.add_argument("--short", action="store_true", help="--only-v4-decode: a few geometries")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    emit(
        bench="env",
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
    )
    fresh_triton_cache()
    if args.only_v4_mhc:
        bench_v4_mhc()
        return 0
    if args.only_moe_align:
        bench_moe_align()
        return 0
    if args.only_moe_gemv:
        bench_moe_gemv()
        return 0
    if args.only_v4_decode:
        bench_v4_decode(short=args.short)
        return 0
    if args.only_v4_topk:
        bench_v4_topk()
        return 0
    if args.only_gdn_prefill:
        bench_gdn_prefill(sweep=not args.no_tune)
        return 0
    hbm_gbps = copy_gbps(1 << 31)
    emit(bench="copy", bytes=1 << 31, gbps=round(hbm_gbps, 1))
    bench_kv_store(hbm_gbps, tune=not args.no_tune)
    cases = kernel_cases()
    bench_compile(cases)
    bench_dynamic_vs_specialized(cases)
    bench_gdn_prefill(sweep=not args.no_tune)
    return 0


if __name__ == "__main__":
    sys.exit(main())
