"""DeepSeek-V4.1 Engram: n-gram hash ids and the gated lookup into the hc streams.

Hash: each position hashes the n-grams (n = 2 .. N) ending at it. ``tokens [T, N]`` holds
compressed token ids, column s = the token s positions back (the compressed pad id before
position 0). With one odd multiplier per (engram layer, look-back) the running hash is
``h_n = XOR_{s < n} tokens[s] * multiplier[s]`` (int64, bounded so it cannot overflow); its
id in the layer's table is ``h_n % prime[n - 2][head] + offset[col]``, col =
``(n - 2) * n_heads + head``, every (n, head) owning a disjoint prime-sized range.

Lookup (`engram_reference`): the rows of every column are concatenated and projected to one
key per hc stream plus a shared value; the gate per (token, stream) is
``sigmoid(signed_sqrt(<h, w * key> * rstd(h) * rstd(key) / sqrt(D)))`` and the value is
added to that stream.

Triton: `engram_hash` (one program per BLOCK_T tokens, every engram layer) and `engram`,
the lookup in two kernels: a gathered GEMM (the A operand is loaded straight from the table
rows the hash ids name: no gathered copy; fp32 accumulation and fp32 key/value out) and one
program per (16 tokens, stream) for the norms, the gate and the add. Runtime length:
num_tokens (do_not_specialize); geometry constexpr. Offsets int64.
"""

from __future__ import annotations

import numpy as np
import torch


def engram_hash_reference(
    tokens: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """tokens ``[T, N]`` int64, multipliers ``[L, N]``, primes ``[L, N - 1, heads]``,
    offsets ``[L, (N - 1) * heads]`` -> hash ids ``[T, L, (N - 1) * heads]`` int64."""
    products = tokens[:, None, :] * multipliers[None]  # [T, L, N]
    rolling = products[..., 0]
    hashes = []
    for n in range(1, tokens.shape[1]):
        rolling = torch.bitwise_xor(rolling, products[..., n])
        hashes.append(rolling[..., None] % primes[None, :, n - 1])
    return torch.cat(hashes, dim=-1) + offsets[None]


def engram_reference(streams, hash_ids, table, wkv, q_weight, k_weight, eps: float):
    """streams ``[T, hc, D]``, hash_ids ``[T, cols]`` into table ``[rows, head_dim]``,
    wkv ``[(hc + 1) * D, cols * head_dim]``, q/k weights ``[hc, D]`` -> streams."""
    hc, dim = streams.shape[1], streams.shape[2]
    kv = torch.nn.functional.linear(table[hash_ids].flatten(-2).to(wkv.dtype), wkv)
    key, value = kv.split([hc * dim, dim], dim=-1)
    key = key.float().unflatten(-1, (hc, dim))
    h = streams.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * (q_weight.float() * k_weight.float()) * key).sum(-1) * rstd * dim**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (h + gate[..., None] * value.float()[:, None, :]).to(streams.dtype)


# -- the hash layout, from the config (host, once) -----------------------------------------
def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


def engram_primes(num_layers: int, max_ngram: int, n_heads: int, vocab_size: int):
    """Primes ``[L][N - 1][heads]``: drawn in order above ``vocab_size - 1``, never reused."""
    current, primes = vocab_size - 1, []
    for _ in range(num_layers):
        per_ngram = []
        for _ in range(max_ngram - 1):
            sizes = []
            for _ in range(n_heads):
                current += 1
                while not _is_prime(current):
                    current += 1
                sizes.append(current)
            per_ngram.append(sizes)
        primes.append(per_ngram)
    return primes


def engram_offsets(primes) -> list[list[int]]:
    """Per layer, the start of each (n, head) range in that layer's table."""
    offsets = []
    for layer in primes:
        flat = [p for per_ngram in layer for p in per_ngram]
        offsets.append([sum(flat[:i]) for i in range(len(flat))])
    return offsets


def engram_multipliers(layer_ids, max_ngram: int, compressed_vocab_size: int) -> torch.Tensor:
    """``[L, N]`` odd int64 multipliers from a per-layer generator (seed 10007 * layer id),
    bounded so that ``id * multiplier`` fits int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = []
    for layer_id in layer_ids:
        values = np.random.default_rng(10007 * layer_id).integers(
            0, bound, size=(max_ngram,), dtype=np.int64
        )
        rows.append(torch.from_numpy(values * 2 + 1))
    return torch.stack(rows)


def compressed_token_map(tokenizer_json: str) -> tuple[list[int], int]:
    """Token id -> compressed id (tokens that normalise alike share one id; NFKC, accents
    stripped, lower case, whitespace runs collapsed) and the compressed vocabulary size,
    from the model's tokenizer.json (the `tokenizers` library)."""
    from tokenizers import Regex, Tokenizer, normalizers

    sentinel = "\ue000"  # keeps a token that is exactly one space from stripping to ""
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    tokenizer = Tokenizer.from_file(tokenizer_json)
    ids: dict[str, int] = {}
    lookup = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte token: keyed by its raw form
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup.append(ids.setdefault(key, len(ids)))
    return lookup, len(ids)


# -- Triton ----------------------------------------------------------------------------------
# One program hashes BLOCK_T tokens for every engram layer (int64 products, XOR, modulo).
# Runtime length (never constexpr): num_tokens. Geometry (constexpr): layers, N, heads.
from atom.kernels.platform import use_triton  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: keep the module importable for the references
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn=None, **_: fn or (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


@triton.jit(do_not_specialize=["num_tokens"])
def _engram_hash_kernel(
    tokens_ptr,  # [T, N] int64
    multipliers_ptr,  # [L, N] int64
    primes_ptr,  # [L, N - 1, HEADS] int64
    offsets_ptr,  # [L, (N - 1) * HEADS] int64
    out_ptr,  # [T, L, (N - 1) * HEADS] int64
    num_tokens,
    LAYERS: tl.constexpr,
    N: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = t < num_tokens
    cols: tl.constexpr = (N - 1) * HEADS
    for layer in tl.static_range(LAYERS):
        token = tl.load(tokens_ptr + t * N, mask=mask, other=0)
        rolling = token * tl.load(multipliers_ptr + layer * N)
        for n in tl.static_range(1, N):
            token = tl.load(tokens_ptr + t * N + n, mask=mask, other=0)
            rolling = rolling ^ (token * tl.load(multipliers_ptr + layer * N + n))
            for head in tl.static_range(HEADS):
                col = (n - 1) * HEADS + head
                prime = tl.load(primes_ptr + (layer * (N - 1) + n - 1) * HEADS + head)
                offset = tl.load(offsets_ptr + layer * cols + col)
                out = rolling % prime + offset
                tl.store(out_ptr + (t * LAYERS + layer) * cols + col, out, mask=mask)


def engram_hash(tokens, multipliers, primes, offsets) -> torch.Tensor:
    """Triton `engram_hash_reference` (same arguments, same ids)."""
    if not use_triton(tokens):
        return engram_hash_reference(tokens, multipliers, primes, offsets)
    num_tokens, n = tokens.shape
    layers, _, heads = primes.shape
    out = torch.empty(num_tokens, layers, (n - 1) * heads, dtype=torch.int64, device=tokens.device)
    if num_tokens:
        block = 128
        _engram_hash_kernel[(triton.cdiv(num_tokens, block),)](
            tokens.contiguous(), multipliers.contiguous(), primes.contiguous(),
            offsets.contiguous(), out, num_tokens, LAYERS=layers, N=n, HEADS=heads, BLOCK_T=block,
        )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["num_tokens"])
def _engram_kv_kernel(
    hash_ids_ptr,  # [T, COLS] int64 (row stride stride_hash_row)
    table_ptr,  # [rows, HEAD_DIM]
    wkv_ptr,  # [WIDTH, COLS * HEAD_DIM]
    kv_ptr,  # [T, WIDTH] fp32
    num_tokens,
    stride_hash_row,
    COLS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    w = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    t_mask, w_mask = t < num_tokens, w < WIDTH
    depth: tl.constexpr = COLS * HEAD_DIM
    acc = tl.zeros([BLOCK_T, BLOCK_W], tl.float32)
    for start in range(0, depth, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        k_mask = kk < depth
        col, channel = kk // HEAD_DIM, kk % HEAD_DIM
        mask = t_mask[:, None] & k_mask[None, :]
        ids = tl.load(hash_ids_ptr + t[:, None] * stride_hash_row + col[None, :], mask=mask,
                      other=0)  # fmt: skip
        a = tl.load(table_ptr + ids * HEAD_DIM + channel[None, :], mask=mask, other=0.0)
        b = tl.load(wkv_ptr + w[:, None] * depth + kk[None, :],
                    mask=w_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        acc += tl.dot(a.to(b.dtype), tl.trans(b), input_precision="ieee")
    tl.store(kv_ptr + t[:, None] * WIDTH + w[None, :], acc,
             mask=t_mask[:, None] & w_mask[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["num_tokens"])
def _engram_gate_kernel(
    streams_ptr,  # [T, HC, DIM] (token stride stride_streams_row, stream stride DIM)
    kv_ptr,  # [T, (HC + 1) * DIM] fp32: HC keys, then the value
    weight_ptr,  # [HC, DIM] fp32: q_weight * k_weight
    out_ptr,  # [T, HC, DIM] contiguous
    num_tokens,
    stride_streams_row,
    eps,
    scale,  # DIM^-0.5
    HC: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (BLOCK_T tokens, stream): two passes over DIM (sums, then the add)."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    stream = tl.program_id(1)
    t_mask = tokens < num_tokens
    offs = tl.arange(0, BLOCK_D)
    h_rows = streams_ptr + tokens[:, None] * stride_streams_row + stream * DIM
    kv_rows = kv_ptr + tokens[:, None] * ((HC + 1) * DIM)
    h_sq = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    k_sq = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    dot = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for start in range(0, DIM, BLOCK_D):
        d = start + offs
        mask = t_mask[:, None] & (d < DIM)[None, :]
        h = tl.load(h_rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        key = tl.load(kv_rows + stream * DIM + d[None, :], mask=mask, other=0.0)
        weight = tl.load(weight_ptr + stream * DIM + d, mask=d < DIM, other=0.0)
        h_sq += h * h
        k_sq += key * key
        dot += h * weight[None, :] * key
    rstd = tl.rsqrt(tl.sum(h_sq, axis=1) / DIM + eps) * tl.rsqrt(tl.sum(k_sq, axis=1) / DIM + eps)
    gate_logit = tl.sum(dot, axis=1) * rstd * scale
    root = tl.sqrt(tl.maximum(tl.abs(gate_logit), 1e-6))
    gate = tl.sigmoid(tl.where(gate_logit < 0, -root, root))
    out_rows = out_ptr + (tokens[:, None] * HC + stream) * DIM
    for start in range(0, DIM, BLOCK_D):
        d = start + offs
        mask = t_mask[:, None] & (d < DIM)[None, :]
        h = tl.load(h_rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        value = tl.load(kv_rows + HC * DIM + d[None, :], mask=mask, other=0.0)
        out = h + gate[:, None] * value
        tl.store(out_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def engram(streams, hash_ids, table, wkv, q_weight, k_weight, eps: float) -> torch.Tensor:
    """Triton `engram_reference` (same arguments; key and value stay fp32 between the
    kernels, where the reference rounds them to the weights' dtype)."""
    if not use_triton(streams):
        return engram_reference(streams, hash_ids, table, wkv, q_weight, k_weight, eps)
    num_tokens, hc, dim = streams.shape
    cols, head_dim = hash_ids.shape[1], table.shape[1]
    width = wkv.shape[0]
    assert width == (hc + 1) * dim and wkv.shape[1] == cols * head_dim
    if streams.stride(2) != 1 or streams.stride(1) != dim:
        streams = streams.contiguous()
    if hash_ids.stride(1) != 1:  # a row stride is fine (one layer's columns of all layers')
        hash_ids = hash_ids.contiguous()
    table, wkv = table.contiguous(), wkv.contiguous()
    out = torch.empty(num_tokens, hc, dim, dtype=streams.dtype, device=streams.device)
    if num_tokens == 0:
        return out
    kv = torch.empty(num_tokens, width, dtype=torch.float32, device=streams.device)
    block_t, block_w, block_k = 16, 64, 32
    _engram_kv_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(width, block_w))](
        hash_ids, table, wkv, kv, num_tokens, hash_ids.stride(0),
        COLS=cols, HEAD_DIM=head_dim, WIDTH=width, BLOCK_T=block_t, BLOCK_W=block_w,
        BLOCK_K=block_k,
    )  # fmt: skip
    weight = (q_weight.float() * k_weight.float()).contiguous()
    _engram_gate_kernel[(triton.cdiv(num_tokens, block_t), hc)](
        streams, kv, weight, out, num_tokens, streams.stride(0), eps, dim**-0.5,
        HC=hc, DIM=dim, BLOCK_T=block_t, BLOCK_D=min(256, triton.next_power_of_2(dim)),
    )  # fmt: skip
    return out
