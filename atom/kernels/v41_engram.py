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

Triton: `engram_hash` (one program per BLOCK_T tokens, every engram layer). Runtime length:
num_tokens (do_not_specialize); geometry constexpr. Offsets int64. The lookup runs its
torch reference on CPU and CUDA: a Triton lookup lost to it and sits beside the benchmarks
as a candidate (benchmarks/candidates/v41_engram_lookup.py, figures in docs/benchmarks.md).
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
