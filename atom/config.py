"""Engine configuration: one dataclass, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atom import envs
from atom.fusions import Fusions

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


KV_CACHE_DTYPES = ("auto", "fp8")
SPECULATIVE_METHODS = ("ngram", "draft")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_dtype(name: str | torch.dtype | None, device: str) -> torch.dtype:
    """`auto` (or None) is float32 on CPU and bfloat16 on CUDA."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}") from None


@dataclass
class Config:
    """Everything the engine needs to know before it loads a model.

    KV-cache size: on CUDA from `gpu_memory_utilization` (fraction of the device's memory
    the engine may use in all); on CPU from `kv_cache_memory_bytes`. `num_kvcache_blocks`
    overrides both (tests use it to force preemption).
    """

    model: str | None = None  # HF directory or .gguf file; None = embedded SmolLM2
    device: str = field(default_factory=default_device)
    dtype: str | torch.dtype | None = "auto"
    max_model_len: int | None = None  # None = the model's context length (capped at 8192)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    # KV-cache storage: auto = the model's dtype; fp8 = e4m3 with per-token-per-head scales
    # (about half the memory of bf16, see atom/kernels/kv_cache.py).
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int = 1 << 30
    num_kvcache_blocks: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    cuda_graph_batch_sizes: list[int] | None = None  # None = 1, 2, 4, 8, then steps of 16
    seed: int = 0
    # Schedule step N+1 while step N runs (None: on for CUDA, off for CPU).
    async_scheduling: bool | None = None
    # How step metadata reaches the device: direct | packed (None: ATOM_H2D_BACKEND).
    h2d_backend: str | None = None
    # Full per-buffer publication checks (None: ATOM_H2D_CHECKED; tests turn it on).
    h2d_checked: bool | None = None
    # Run each batch as this many micro-batches, each on its own runner slot: 1 or 2
    # (two-batch overlap); under pipeline parallelism 1..8, default (None) one per stage.
    num_micro_batches: int | None = None
    # Where profiler traces go (None: ATOM_TORCH_PROFILER_DIR; profiling off if neither).
    profiler_dir: str | None = None
    load_format: str = "auto"  # "dummy": random weights in the checkpoint's shapes (benchmarks)
    skip_tokenizer_init: bool = False  # token-id prompts only; outputs carry no text
    # Tensor parallelism: N spawned ranks, each holding 1/N of the heads, MLP and vocabulary.
    tensor_parallel_size: int = 1
    # Pipeline parallelism: the decoder layers split into P contiguous stages, each on its
    # own ranks (P x tensor_parallel_size ranks in all); micro-batches overlap the stages.
    pipeline_parallel_size: int = 1
    # Data parallelism: D engine replicas (each with its own TP x PP ranks, spawned even
    # when that is one rank), requests routed to the least-loaded one.
    data_parallel_size: int = 1
    # Where the ranks meet (a TCPStore the engine binds before spawning them). One node:
    # master_port 0 = any free port. Several nodes: node 0 hosts the store at
    # master_addr:master_port (a fixed port), nodes 1.. join it; each runs N / nnodes ranks.
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    nnodes: int = 1
    node_rank: int = 0
    distributed_timeout_s: float = 1800.0  # rendezvous and collectives
    # Speculative decoding (atom/model_engine/speculative): None = off; "ngram" = prompt
    # lookup in the sequence's own context; "draft" = a smaller model (`speculative_model`,
    # same vocabulary) proposes. Each step verifies up to `num_speculative_tokens` proposals
    # per sequence in one target forward. A step with drafts (or one whose successor may
    # draft) completes before the next is scheduled; others overlap as usual.
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int = 2  # shortest suffix the n-gram proposer matches
    ngram_max: int = 4  # longest suffix tried first
    speculative_model: str | None = None  # the draft model (method "draft")
    # Fused kernels of the CUDA path, one switch each (atom/fusions.py); None = the
    # defaults there, overridden by the ATOM_FUSE_* (and ATOM_PDL_*) environment variables.
    fusions: Fusions | None = None
    # The batch-1 GEMV policy (atom/kernels/gemv_policy.py): measure | fused | unfused, its
    # seconds of timed trials per process, and the directory of its cache file. None: the
    # ATOM_GEMV_POLICY, ATOM_GEMV_TRIAL_BUDGET_S and ATOM_CACHE_DIR variables, else
    # measure, 1 s and ~/.cache/atom.
    gemv_policy: str | None = None
    gemv_trial_budget_s: float | None = None
    cache_dir: str | None = None
    # Torch threads of a CPU engine (atom/model_engine/cpu_threads.py). None: ATOM_CPU_THREADS,
    # else OMP_NUM_THREADS, else the cores free at start (resolved when the engine starts).
    cpu_threads: int | None = None
    # A CPU engine's fp32 linear layers (atom/kernels/cpu_linear.py): "packed" (weights packed
    # once for oneDNN) or "dense" (F.linear). None: ATOM_CPU_LINEAR, else packed.
    cpu_linear: str | None = None
    # The compiled-grammar cache's bound in bytes; None: ATOM_GRAMMAR_CACHE_MB (512 MiB).
    grammar_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device=cuda was asked for but no CUDA device is available")
        self.torch_dtype = parse_dtype(self.dtype, self.device)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.h2d_backend is None:
            self.h2d_backend = envs.h2d_backend()
        elif self.h2d_backend not in envs.H2D_BACKENDS:
            raise ValueError(
                f"h2d_backend {self.h2d_backend!r} is not known; valid values: {', '.join(envs.H2D_BACKENDS)}"
            )
        if self.h2d_checked is None:
            self.h2d_checked = envs.h2d_checked()
        if self.profiler_dir is None:
            self.profiler_dir = envs.torch_profiler_dir()
        if self.fusions is None:
            self.fusions = Fusions.from_env()
        self._resolve_gemv_policy()
        if self.async_scheduling is None:
            self.async_scheduling = self.device.startswith("cuda")
        if self.device == "cpu" and self.torch_dtype != torch.float32:
            # CPU kernels are the torch references; they work in any dtype but fp32 is
            # what HF parity is measured in. Allow it anyway: the user asked.
            pass
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_kvcache_blocks is not None and self.num_kvcache_blocks < 1:
            raise ValueError(f"num_kvcache_blocks must be >= 1, got {self.num_kvcache_blocks}")
        self._validate_parallelism()
        self._validate_speculation()  # after num_micro_batches is resolved

    def _resolve_gemv_policy(self) -> None:
        if self.gemv_policy is None:
            self.gemv_policy = envs.gemv_policy()
        elif self.gemv_policy not in envs.GEMV_POLICY_MODES:
            raise ValueError(
                f"gemv_policy must be one of {', '.join(envs.GEMV_POLICY_MODES)}, "
                f"got {self.gemv_policy!r}"
            )
        if self.gemv_trial_budget_s is None:
            self.gemv_trial_budget_s = envs.gemv_trial_budget_s()
        if self.cache_dir is None:
            self.cache_dir = envs.cache_dir()
        if self.cpu_threads is None:
            self.cpu_threads = envs.cpu_threads()  # still None: the cores free at start
        elif self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.cpu_linear is None:
            self.cpu_linear = envs.cpu_linear()
        elif self.cpu_linear not in envs.CPU_LINEAR_MODES:
            raise ValueError(
                f"cpu_linear must be one of {', '.join(envs.CPU_LINEAR_MODES)}, "
                f"got {self.cpu_linear!r}"
            )
        if self.grammar_cache_bytes is None:
            self.grammar_cache_bytes = envs.grammar_cache_bytes()

    def _validate_speculation(self) -> None:
        method = self.speculative_method
        if method is None:
            if self.speculative_model is not None:
                raise ValueError(
                    "speculative_model is set but speculative_method is not; pass "
                    "speculative_method='draft' (--speculative-method draft)"
                )
            return
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)} or None, "
                f"got {method!r}"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"ngram_min and ngram_max must satisfy 1 <= min <= max, got "
                f"{self.ngram_min} and {self.ngram_max}"
            )
        if method == "draft" and not self.speculative_model:
            raise ValueError(
                "speculative_method='draft' needs speculative_model (--speculative-model PATH)"
            )
        if self.ranks_per_replica > 1 or self.num_micro_batches > 1:
            raise ValueError(
                "speculative decoding is not supported yet with tensor parallelism, pipeline "
                "parallelism or micro-batches (tensor_parallel_size, pipeline_parallel_size "
                "and num_micro_batches must be 1)"
            )

    @property
    def ranks_per_replica(self) -> int:
        """Ranks of one engine replica: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _validate_parallelism(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        pp, dp = self.pipeline_parallel_size, self.data_parallel_size
        for name, value in (
            ("tensor_parallel_size", tp),
            ("pipeline_parallel_size", pp),
            ("data_parallel_size", dp),
            ("nnodes", nnodes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        micro = self.num_micro_batches
        if micro is None:
            micro = self.num_micro_batches = pp
        most = 8 if pp > 1 else 2
        if isinstance(micro, bool) or not isinstance(micro, int) or not 1 <= micro <= most:
            raise ValueError(
                f"num_micro_batches must be an integer in [1, {most}]"
                f"{' under pipeline parallelism' if pp > 1 else ''}, got {micro!r}"
            )
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank must be in [0, {nnodes}), got {self.node_rank}")
        if dp > 1 and nnodes > 1:
            raise ValueError("data parallelism over several nodes is not supported yet")
        ranks = tp * pp
        if ranks % nnodes:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size ({tp} x {pp} = {ranks}) must "
                f"be a multiple of nnodes {nnodes} (every node runs the same number of ranks)"
            )
        if not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}")
        if nnodes > 1 and self.master_port == 0:
            raise ValueError(
                "a multi-node run needs a fixed master_port (--master-port) given to every "
                "node; port 0 (pick any free port) only works on one node"
            )
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if ranks * dp > 1 and self.device.startswith("cuda"):
            if self.device != "cuda":
                raise ValueError(
                    f"with tensor, pipeline or data parallelism each rank uses "
                    f"cuda:<local rank>; pass device='cuda', not {self.device!r}"
                )
            local, found = ranks * dp // nnodes, torch.cuda.device_count()
            if local > found:
                raise ValueError(
                    f"{dp} replica(s) of tensor_parallel_size {tp} x pipeline_parallel_size "
                    f"{pp} over {nnodes} node(s) need {local} GPUs per node, this node has "
                    f"{found}"
                )
