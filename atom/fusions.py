"""Which fused kernels the CUDA path uses (issue 17: batch-1 decode with fewer kernels).

One switch per fusion, each an environment variable (``1`` on, ``0`` off) read once when a
``Config`` is built (atom/envs.py), or a ``Fusions`` passed as ``Config.fusions``.
``DEFAULTS`` holds the default of each: a fusion is on by default only where the ablation
(``python -m benchmarks.offline_throughput --ablate``) shows it winning on every shape of
the batch-1 matrix, against every fusion off; the figures and the alternatives that lost
are in docs/benchmarks.md. Flip a default there, after measuring.
rope_kv_write and gemv_rope_kv serve bf16/fp32 caches; fp8 caches keep rotary + store
(atom/attention/mha.py).

    rope_kv_write   ATOM_FUSE_ROPE_KV      RoPE of q and k and the KV-cache write (bf16 or
                                           fp8) in one kernel reading the fused QKV output
                                           in place (atom/kernels/rotary_kv.py), instead of
                                           a rotary kernel and a store kernel.
    greedy_argmax   ATOM_FUSE_ARGMAX       greedy sampling through a two-stage Triton argmax
                                           over the vocabulary (atom/kernels/argmax.py)
                                           instead of torch's argmax.
    gemv_silu       ATOM_FUSE_GEMV_SILU    at one token (batch-1 decode), the MLP's gate/up
                                           projection as a Triton GEMV with SiLU * up in its
                                           epilogue (atom/kernels/gemv.py) instead of cuBLAS
                                           plus the SiLU kernel.
    gemv_linear     ATOM_FUSE_GEMV_LINEAR  at one token, the other linear
                                           layers without bias (q/k/v, o, down, the LM
                                           head; every model's parallel_layers) as the
                                           same Triton GEMV instead of cuBLAS (no split-K
                                           reduce kernels).
    norm_gemv       ATOM_FUSE_NORM_GEMV    at one token, a Llama layer's two
                                           RMSNorms (with their residual adds) folded into
                                           the GEMVs after them: q/k/v, and gate/up with
                                           SiLU * up (atom/kernels/gemv.py gemv_rms_norm).
    gemv_rope_kv    ATOM_FUSE_GEMV_ROPE_KV with norm_gemv, at one token (batch-1 decode,
                                           bf16/fp32 caches): the RoPE of q and k and the
                                           KV-cache write in the qkv GEMV's epilogue
                                           (atom/kernels/gemv_rope_kv.py) instead of the
                                           rope_kv_write kernel after it.
    pdl             ATOM_FUSE_PDL          programmatic dependent launch of the Triton
                                           kernels of a decode step (one-row GEMVs of under
                                           4 MB of weight, paged decode and its merge,
                                           RMSNorm): each may start while the one before it
                                           ends, loading its weights, block ids or cached
                                           K / V before it waits (atom/kernels/pdl.py;
                                           Hopper or newer). Two measurement knobs
                                           beside it: ATOM_PDL_KERNELS (``pdl_kernels``)
                                           and ATOM_PDL_RELEASE (``pdl_release``).

The three GEMV switches allow the one-row kernel of atom/kernels/gemv.py (batch-1 decode,
as in the decode graph of batch size 1); whether a layer takes it, and with which tile, is
measured per layer shape, GPU, dtype and Triton version when the engine first runs it
(atom/kernels/gemv_policy.py: a short timed trial against the unfused cuBLAS path under
CUDA graphs, cached on disk). Where cuBLAS streams the weight faster (the 7-8B shapes'
large matrices) the layer keeps the unfused path with the switch on, and so do the PDL
chains (only a Triton GEMV joins one); more rows keep cuBLAS. gemv_silu, norm_gemv and
gemv_rope_kv also serve FP8 layers with one scale per output row (FP8_DYNAMIC's weights;
the weight dtype is in the policy's key, the unfused path there the FP8 GEMV of
atom/kernels/fp8_linear.py); block-scaled FP8 and int4 layers stay unfused
(docs/quantization.md).

The residual add was already fused into RMSNorm (atom/kernels/rmsnorm.py, used by
PreNormDecoderLayer); `norm_gemv` goes one step further and folds the norm into the next
linear layer. So there is no switch for a residual epilogue in o_proj / down: the add
lives in the next norm (or norm + GEMV) kernel already, moving it would remove no kernel.

Every fusion changes the CUDA path only; on CPU the engine runs the torch references as
before. The ModelRunner puts its config's Fusions into the forward context (layers read it
there) and hands ``greedy_argmax`` to its Sampler. A CUDA graph keeps the fusions it was
captured with.
"""

from __future__ import annotations

from dataclasses import dataclass

from atom import envs

# field -> (environment variable, default). Flip a default here after the ablation.
DEFAULTS = {
    "rope_kv_write": ("ATOM_FUSE_ROPE_KV", True),
    "greedy_argmax": ("ATOM_FUSE_ARGMAX", True),
    "gemv_silu": ("ATOM_FUSE_GEMV_SILU", True),
    "gemv_linear": ("ATOM_FUSE_GEMV_LINEAR", True),
    "norm_gemv": ("ATOM_FUSE_NORM_GEMV", True),
    "gemv_rope_kv": ("ATOM_FUSE_GEMV_ROPE_KV", True),
    "pdl": ("ATOM_FUSE_PDL", True),
}


class FusionSettingError(ValueError):
    """An ATOM_FUSE_* variable holds something other than 0 or 1."""


@dataclass(frozen=True)
class Fusions:
    rope_kv_write: bool = DEFAULTS["rope_kv_write"][1]
    greedy_argmax: bool = DEFAULTS["greedy_argmax"][1]
    gemv_silu: bool = DEFAULTS["gemv_silu"][1]
    gemv_linear: bool = DEFAULTS["gemv_linear"][1]
    norm_gemv: bool = DEFAULTS["norm_gemv"][1]
    gemv_rope_kv: bool = DEFAULTS["gemv_rope_kv"][1]
    pdl: bool = DEFAULTS["pdl"][1]
    # Which GEMVs join a PDL chain and when a GEMV releases the next kernel (measurement
    # knobs, atom/kernels/pdl.py; ATOM_PDL_KERNELS, ATOM_PDL_RELEASE): not switches.
    pdl_kernels: str = "latency"  # latency | small | all
    pdl_release: str = "start"  # start | end
    # The longest new run from which a GDN prefill takes the chunked delta-rule kernels
    # (atom/kernels/gdn_chunk.py use_chunked; ATOM_GDN_CHUNKED_MIN_TOKENS): not a switch.
    gdn_chunked_min_tokens: int = 8192
    # Quantized linear layers on CUDA (atom/models/quantization): the Triton / FP8 kernels
    # (ATOM_QUANT_KERNELS=0: dequantize, then F.linear, for A/B runs), and whether a
    # quantized GEMV shape times its tile candidates once (ATOM_QUANT_GEMV_TUNE=0: the
    # heuristic's tile; atom/kernels/gemv_tiles.py tuned_quant_gemv): not switches.
    quant_kernels: bool = True
    quant_gemv_tune: bool = True

    @classmethod
    def from_env(cls) -> Fusions:
        """The defaults, overridden by the ATOM_FUSE_* variables that are set, and the PDL
        knobs ATOM_PDL_KERNELS / ATOM_PDL_RELEASE (all read in atom/envs.py)."""
        settings = envs.fusion_settings([variable for variable, _ in DEFAULTS.values()])
        values = {}
        for name, (variable, default) in DEFAULTS.items():
            raw = settings.get(variable)
            if raw is None:
                values[name] = default
            elif raw in ("1", "true", "on"):
                values[name] = True
            elif raw in ("0", "false", "off"):
                values[name] = False
            else:
                raise FusionSettingError(f"{variable}={raw!r}: use 1 (fusion on) or 0 (off)")
        return cls(
            **values,
            pdl_kernels=envs.pdl_kernels(),
            pdl_release=envs.pdl_release(),
            gdn_chunked_min_tokens=envs.gdn_chunked_min_tokens(),
            quant_kernels=envs.flag("ATOM_QUANT_KERNELS", True),
            quant_gemv_tune=envs.flag("ATOM_QUANT_GEMV_TUNE", True),
        )

    @classmethod
    def none(cls) -> Fusions:
        """Every fusion off: the kernels of the engine before issue 17 (the baseline)."""
        return cls(**dict.fromkeys(DEFAULTS, False))

    @classmethod
    def only(cls, *names: str) -> Fusions:
        """The named fusions on, every other off (the ablation's configurations)."""
        unknown = set(names) - set(DEFAULTS)
        if unknown:
            raise FusionSettingError(f"unknown fusions {sorted(unknown)}; known: {list(DEFAULTS)}")
        return cls(**{name: name in names for name in DEFAULTS})

    def enabled(self) -> list[str]:
        return [name for name in DEFAULTS if getattr(self, name)]


def names() -> list[str]:
    return list(DEFAULTS)
