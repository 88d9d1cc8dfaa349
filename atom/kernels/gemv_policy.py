"""Which batch-1 linear layers run the Triton GEMV, with which tiles: measured per shape.

The one-row GEMV of atom/kernels/gemv.py wins where a layer is bound by latency (small
weights: no split-K reduce kernel, the norm or SiLU folded in, PDL) and loses where a
large matrix must stream at full bandwidth (cuBLAS reads the 8B MLP's 4096 x 14336 at
about twice its rate; issue 30). No table of measured shapes decides that: for each
GEMV site a forward meets at one row, keyed by (GPU name, in_features, weight rows,
SiLU epilogue, norm prologue, RoPE epilogue, bias, dtype, weight dtype, PDL, Triton and
torch versions), ``GemvPolicy``
times the unfused path (cuBLAS ``F.linear`` plus atom's separate ``rms_norm`` /
``silu_and_mul`` kernels, what the fusion replaces) against a few tile candidates under
CUDA graphs, once, the first time the site runs outside a graph capture (the warm-up
forward before the batch-1 decode graph is captured), and keeps the Triton GEMV only
where its best tile is faster by ``MARGIN``; else the layer keeps the unfused path. So
a default never loses to every fusion off by more than the trial's noise. A site with the
RMSNorm prologue (``norm_gemv``) has a third way, which its fallback runs: the norm
kernel, then the plain site (which decides its own Triton GEMV or cuBLAS). Its fused norm
must beat that too: the prologue re-reads x, the residual and the norm weight in every
program, which costs the wide MLP projections more than a norm kernel's launch.

An FP8 layer with one scale per row (``weight_scale``; block-scaled FP8 and int4 stay
unfused) is a site of its own (the weight dtype is in the key: bf16 and FP8 entries never
mix): its unfused path is what the layer runs without the fusion, atom/kernels/fp8_linear.py's
FP8 GEMV plus the separate norm / rotary / SiLU kernels, and its candidates read twice as
many inputs per chunk (the same bytes per tile; gemv_trial.py ``candidates``).

The trials share a budget (``Config.gemv_trial_budget_s``, from ATOM_GEMV_TRIAL_BUDGET_S:
1 s of timing per process;
compiling the candidates is not counted: Triton caches it on disk). A site met once the
budget is spent keeps the unfused path and is not cached (the next start measures it).
Choices are cached in a JSON file (``gemv_policy.json`` in ``Config.cache_dir``, from
ATOM_CACHE_DIR, default ~/.cache/atom) under the full key, so the next start reads them: an entry of
another GPU, Triton or torch is another key (never read for this one); an entry that
does not parse or holds an impossible tile is ignored and measured again, never
trusted; a file that is not JSON is ignored whole (and rewritten).

``Config.gemv_policy`` (ATOM_GEMV_POLICY): ``measure`` (the default), ``fused`` (every site that fits takes
the Triton GEMV with its heuristic tile: tests, A/B runs) or ``unfused`` (never).
Without a CUDA device nothing is measured: a site keeps the unfused path (the CPU
engine runs the torch references anyway; interpreter tests ask for ``fused``).

PDL (atom/kernels/pdl.py) follows the choice: only a GEMV chosen to run in Triton joins
a PDL chain (a cuBLAS GEMV launches as it always did), and the trial measures each
candidate with the forward's PDL setting. ``report()`` lists each choice and why (the
start-up log at INFO and ``--profile-kernels`` print it).

The ModelRunner makes the process's policy from its Config (``configure``) unless a test or
benchmark set one (``set_policy``); the policy hands its tiles to atom/kernels/gemv_tiles.py,
where the kernels ask for them (they never import this module).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from atom import envs
from atom.forward_context import current_fusions
from atom.kernels import gemv_tiles
from atom.kernels.gemv import fits_gemv
from atom.kernels.gemv_rope_kv import RopeKV
from atom.kernels.gemv_tiles import GemvConfig, GemvSite, heuristic_config
from atom.kernels.gemv_trial import (  # noqa: F401 (candidates: this module's API)
    TOLERANCE,
    TrialInputs,
    candidates,
    cuda_seconds_per_call,
    first_output,
)

logger = logging.getLogger(__name__)

MODES = envs.GEMV_POLICY_MODES  # measure | fused | unfused
MARGIN = 0.03  # the Triton GEMV must beat the unfused path by 3% (a step adds its noise)
BUDGET_S = 1.0  # seconds of timed trials per process
CACHE_VERSION = 4  # 2: a norm site also weighed against the norm kernel + the plain GEMV;
# 3: the key says whether the layer has a bias; 4: and the weight's dtype (FP8 or x's)
_BLOCK_NS = (1, 2, 4, 8, 16)
_BLOCK_KS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


class GemvPolicyError(ValueError):
    """ATOM_GEMV_POLICY or ATOM_GEMV_TRIAL_BUDGET_S holds something unusable."""


@dataclass
class GemvChoice:
    """What a site runs: ``config`` the Triton GEMV's tile, None the unfused path."""

    config: GemvConfig | None
    reason: str
    source: str  # "measured", "cached", "fallback", "forced"
    unfused_us: float | None = None
    fused_us: float | None = None  # the best candidate's
    candidates: dict = field(default_factory=dict)  # label -> us


def valid_config(values) -> GemvConfig | None:
    """A tile read from the cache, or None where it cannot be one of ours."""
    if not isinstance(values, list) or len(values) != 4:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    block_n, block_k, warps, stages = values
    if block_n not in _BLOCK_NS or block_k not in _BLOCK_KS:
        return None
    if warps not in (1, 2, 4, 8, 16) or not 1 <= stages <= 8:
        return None
    return GemvConfig(block_n, block_k, warps, stages)


def cache_path_in(cache_dir: str | None) -> str | None:
    """The policy's cache file in ``cache_dir`` (None: no file, nothing kept)."""
    return None if cache_dir is None else os.path.join(cache_dir, "gemv_policy.json")


class GemvPolicy:
    """The per-process choices of the batch-1 GEMV sites (see the module docstring).

    ``timer(run, weights, calls, replays) -> seconds per call`` times a candidate (a test
    passes its own; with it the trial also runs on CPU tensors, under the interpreter).
    """

    def __init__(
        self,
        mode: str = "measure",
        cache_path: str | None = None,
        budget_s: float = BUDGET_S,
        timer: Callable | None = None,
        calls: int = 8,
        replays: int = 5,
        rotation_bytes: int | None = None,
    ):
        if mode not in MODES:
            raise GemvPolicyError(f"ATOM_GEMV_POLICY={mode!r}: use one of {', '.join(MODES)}")
        self.mode = mode
        self.cache_path = cache_path
        self.budget_s = budget_s
        self.timer = timer
        self.calls, self.replays = calls, replays
        self.rotation_bytes = rotation_bytes
        self.spent_s = 0.0  # timed trials so far
        self.compile_s = 0.0  # compiling candidates (not in the budget)
        self.choices: dict[tuple, GemvChoice] = {}  # (cache key) -> choice
        self.engine_made = False  # made by `configure` (an engine replaces it), not set_policy
        self._cache: dict | None = None  # the file's entries, read once

    def start_engine(self) -> None:
        """A new engine starts: its trials get the whole budget again."""
        self.spent_s = self.compile_s = 0.0

    def summary(self) -> str:
        fused = sum(choice.config is not None for choice in self.choices.values())
        return (f"{fused} of {len(self.choices)} batch-1 GEMV sites run the Triton GEMV "
                f"(mode {self.mode}; trials {1e3 * self.spent_s:.0f} ms, compiling "
                f"{self.compile_s:.1f} s; cache {self.cache_path})")  # fmt: skip

    # -- the decision ----------------------------------------------------------------------
    def config_for(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        silu_mul: bool = False,
        norm: bool = False,
        rope: RopeKV | None = None,
        bias: torch.Tensor | None = None,
        weight_scale: torch.Tensor | None = None,
    ) -> GemvConfig | None:
        """The Triton GEMV's tile for this layer at one row, or None: the unfused path.
        ``rope``: the qkv GEMV with the RoPE + KV-write epilogue (against the GEMV and
        ``rotary_kv_write``; the trial writes no cache slot). ``bias``: the layer's (the
        trial adds one of its shape to both paths). ``weight_scale``: an FP8 weight's
        float32 scale per row (the unfused path: the FP8 linear and the separate kernels)."""
        if not fits_gemv(x, weight, weight_scale) or not _bias_fits(bias, x, weight, silu_mul):
            return None
        if self.mode == "unfused":
            return None
        dtype = _dtype_name(x)
        weight_dtype = None if weight_scale is None else _dtype_name(weight)
        site = GemvSite(
            weight.shape[1], weight.shape[0], silu_mul, norm, dtype, rope is not None,
            bias is not None, weight_dtype,
        )  # fmt: skip
        if self.mode == "fused":
            return heuristic_config(site.in_features, site.rows, site.silu_mul, weight_dtype)
        key = self._key(site, x.device)
        choice = self.choices.get(key)
        if choice is None:
            choice = self._decide(site, key, x.device, weight, rope, weight_scale)
            if choice is None:  # inside a graph capture: nothing may be timed there
                return None
            self.choices[key] = choice
            logger.info("GEMV policy: %s -> %s", site.label(), _describe(choice))
        return choice.config

    def tile(self, site: GemvSite, device: torch.device) -> GemvConfig | None:
        """The chosen tile of a site decided before (None: unfused or not decided)."""
        if self.mode == "fused" or not self.choices:
            return None  # the heuristic's
        choice = self.choices.get(self._key(site, device))
        return None if choice is None else choice.config

    def _decide(self, site, key, device, weight, rope=None, weight_scale=None):
        """The site's choice: cached, measured, or a fallback (None inside a capture)."""
        if self.timer is None and device.type != "cuda":
            return GemvChoice(None, "no CUDA device: nothing to measure", "fallback")
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        cached = self._read_cached(key)
        if cached is not None:
            return cached
        if self.spent_s >= self.budget_s:
            return GemvChoice(None, f"trial budget of {self.budget_s:g} s spent", "fallback")
        try:
            choice = self._trial(site, weight, rope, weight_scale)
        except Exception as error:  # e.g. out of memory: the unfused path, measured next start
            logger.warning("GEMV policy: the trial of %s failed: %r", site.label(), error)
            return GemvChoice(None, f"trial failed: {error!r}"[:200], "fallback")
        self._write_cached(key, choice)
        return choice

    def _trial(self, site: GemvSite, weight: torch.Tensor, rope=None, weight_scale=None):
        """Time the unfused path and each candidate tile on copies of ``weight`` (enough
        of them that the rotation does not fit in L2); keep the fastest candidate whose
        output matches the unfused path's, if it beats it by MARGIN."""
        weights = self._rotation(weight)
        inputs = TrialInputs(site, weight, rope, weight_scale)
        timer = self.timer or cuda_seconds_per_call
        unfused = inputs.unfused()
        expected = first_output(unfused(weight)).float()
        started = time.perf_counter()
        unfused_us = 1e6 * timer(unfused, weights, self.calls, self.replays)
        self.spent_s += time.perf_counter() - started
        measured = {}
        for config in candidates(site):
            us = self._time_candidate(inputs.fused(config), weights, expected)
            if us is not None:
                measured[config] = us
        table = {_label(c): round(us, 3) for c, us in measured.items()}
        if not measured:
            return GemvChoice(None, "no candidate matched the unfused output", "measured",
                              unfused_us, None, table)  # fmt: skip
        # A norm site's fallback is the norm kernel, then the plain site's own choice:
        # the fused norm must also beat the norm kernel + the plain Triton GEMV.
        apart_us, apart = self._apart(inputs, site, weights, expected, rope)
        if apart is not None:
            table[("norm apart", *_label(apart))] = round(apart_us, 3)
        best = min(measured, key=measured.get)
        speedup = unfused_us / measured[best]
        if measured[best] <= min(unfused_us, apart_us) * (1 - MARGIN):
            reason = f"Triton {_label(best)} {speedup:.2f}x the unfused path"
            return GemvChoice(best, reason, "measured", unfused_us, measured[best], table)
        if apart_us < unfused_us:
            reason = (f"norm apart: the norm kernel + Triton {_label(apart)} "
                      f"{unfused_us / apart_us:.2f}x the unfused path, the fused norm "
                      f"{speedup:.2f}x")  # fmt: skip
            return GemvChoice(None, reason, "measured", unfused_us, measured[best], table)
        reason = f"unfused: the best Triton tile {_label(best)} is {speedup:.2f}x"
        return GemvChoice(None, reason, "measured", unfused_us, measured[best], table)

    def _apart(self, inputs, site, weights, expected, rope) -> tuple[float, GemvConfig | None]:
        """(us, tile) of a norm site's best 'norm kernel, then the plain Triton GEMV'
        (inf, None for a site without the norm or with the RoPE epilogue, or an FP8 site
        without the SiLU: its plain layer is the FP8 linear, the unfused path itself)."""
        if not site.norm or rope is not None or (site.weight_dtype and not site.silu_mul):
            return math.inf, None
        plain = dataclasses.replace(site, norm=False)
        best_us, best = math.inf, None
        for config in candidates(plain):
            us = self._time_candidate(inputs.apart(config), weights, expected)
            if us is not None and us < best_us:
                best_us, best = us, config
        return best_us, best

    def _time_candidate(self, run, weights, expected) -> float | None:
        """us per call of a candidate path, None where its output is not the unfused
        path's (within TOLERANCE): never timed, never chosen. Its first call compiles it
        (once; counted in compile_s, not the budget)."""
        compiling = time.perf_counter()
        got = first_output(run(weights[0])).float()
        self.compile_s += time.perf_counter() - compiling
        if not bool(((got - expected).abs() <= TOLERANCE * (1 + expected.abs())).all()):
            return None
        started = time.perf_counter()
        us = 1e6 * (self.timer or cuda_seconds_per_call)(run, weights, self.calls, self.replays)
        self.spent_s += time.perf_counter() - started
        return us

    def _rotation(self, weight: torch.Tensor) -> list[torch.Tensor]:
        """``weight`` and enough copies that together they are twice the L2 (a call never
        finds its weight in L2, as in a decode step); a weight past that alone."""
        target = self.rotation_bytes
        if target is None:
            l2 = 50 << 20
            if weight.is_cuda:
                props = torch.cuda.get_device_properties(weight.device)
                l2 = getattr(props, "L2_cache_size", l2) or l2
            target = 2 * l2
        nbytes = weight.numel() * weight.element_size()
        copies = max(1, -(-target // max(nbytes, 1)))
        return [weight] + [weight.clone() for _ in range(copies - 1)]

    # -- the cache -------------------------------------------------------------------------
    def _key(self, site: GemvSite, device: torch.device) -> tuple:
        name = _device_name(device)
        pdl = bool(current_fusions().pdl)
        return (name, _triton_version(), torch.__version__, site.in_features, site.rows,
                site.silu_mul, site.norm, site.dtype, pdl, site.rope, site.bias,
                site.weight_dtype)  # fmt: skip

    @staticmethod
    def key_string(key: tuple) -> str:
        return "|".join(str(part) for part in key)

    def _entries(self) -> dict:
        if self._cache is None:
            self._cache = {}
            if self.cache_path and os.path.exists(self.cache_path):
                try:
                    with open(self.cache_path) as f:
                        data = json.load(f)
                    if isinstance(data, dict) and data.get("version") == CACHE_VERSION:
                        entries = data.get("entries")
                        self._cache = entries if isinstance(entries, dict) else {}
                    else:
                        logger.warning("GEMV policy: %s is of another version: ignored",
                                       self.cache_path)  # fmt: skip
                except (OSError, ValueError) as error:
                    logger.warning("GEMV policy: %s is unreadable (%r): ignored",
                                   self.cache_path, error)  # fmt: skip
        return self._cache

    def _read_cached(self, key: tuple) -> GemvChoice | None:
        entry = self._entries().get(self.key_string(key))
        if not isinstance(entry, dict) or entry.get("key") != [*key]:
            return None
        unfused_us = entry.get("unfused_us")
        if not isinstance(unfused_us, (int, float)) or not unfused_us > 0:
            return None
        if entry.get("choice") == "unfused":
            config = None
        else:
            config = valid_config(entry.get("choice"))
            if config is None:  # an impossible tile: measured again, never trusted
                return None
        reason = str(entry.get("reason", ""))[:200]
        fused_us = (
            entry.get("fused_us") if isinstance(entry.get("fused_us"), (int, float)) else None
        )
        return GemvChoice(config, reason, "cached", float(unfused_us), fused_us)

    def _write_cached(self, key: tuple, choice: GemvChoice) -> None:
        if not self.cache_path:
            return
        entries = self._entries()
        entries[self.key_string(key)] = dict(
            key=[*key],
            choice="unfused" if choice.config is None else list(_label(choice.config)),
            reason=choice.reason,
            unfused_us=choice.unfused_us,
            fused_us=choice.fused_us,
            candidates={str(list(k)): v for k, v in choice.candidates.items()},
        )
        try:
            os.makedirs(os.path.dirname(self.cache_path) or ".", exist_ok=True)
            temporary = f"{self.cache_path}.{os.getpid()}.tmp"
            with open(temporary, "w") as f:
                json.dump(dict(version=CACHE_VERSION, entries=entries), f, indent=1)
            os.replace(temporary, self.cache_path)  # readers see the old file or the new
        except OSError as error:
            logger.warning("GEMV policy: cannot write %s (%r)", self.cache_path, error)

    # -- what was chosen -------------------------------------------------------------------
    def report(self) -> list[dict]:
        """One record per decided site: its shape, the choice, why, and its timings."""
        rows = []
        for key, choice in self.choices.items():
            in_features, rows_, silu_mul, norm, dtype = key[3:8]
            site = GemvSite(in_features, rows_, silu_mul, norm, dtype, *key[9:12])
            rows.append(dict(
                site=site.label(), gpu=key[0], pdl=key[8],
                choice="unfused" if choice.config is None else list(_label(choice.config)),
                source=choice.source, reason=choice.reason,
                unfused_us=_rounded(choice.unfused_us), fused_us=_rounded(choice.fused_us),
            ))  # fmt: skip
        return rows


def _bias_fits(bias, x, weight, silu_mul) -> bool:
    """Whether the kernel takes this bias: one per weight row, x's dtype, contiguous (and
    no layer has a bias before the SiLU: that epilogue takes none)."""
    if bias is None:
        return True
    return (
        not silu_mul
        and bias.shape == (weight.shape[0],)
        and bias.dtype == x.dtype
        and bias.is_contiguous()
    )


_DEVICE_NAMES: dict[torch.device, str] = {}


def _device_name(device: torch.device) -> str:
    """The GPU's name (part of every key; read once per device: eager steps ask often)."""
    if device not in _DEVICE_NAMES:
        cuda = device.type == "cuda"
        _DEVICE_NAMES[device] = torch.cuda.get_device_name(device) if cuda else device.type
    return _DEVICE_NAMES[device]


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def _label(config: GemvConfig) -> tuple[int, int, int, int]:
    return (config.block_n, config.block_k, config.num_warps, config.num_stages)


def _rounded(us):
    return None if us is None else round(us, 2)


def _dtype_name(x: torch.Tensor) -> str:
    return str(x.dtype).removeprefix("torch.")


def _describe(choice: GemvChoice) -> str:
    what = "unfused (cuBLAS)" if choice.config is None else f"Triton {_label(choice.config)}"
    timings = ""
    if choice.unfused_us is not None:
        timings = f", unfused {choice.unfused_us:.1f} us"
        if choice.fused_us is not None:
            timings += f", best Triton {choice.fused_us:.1f} us"
    return f"{what} [{choice.source}: {choice.reason}{timings}]"


_policy: GemvPolicy | None = None


def _install(policy: GemvPolicy | None) -> None:
    global _policy
    _policy = policy
    gemv_tiles.use_tile_source(None if policy is None else policy.tile)


def configure(mode: str, cache_dir: str | None, budget_s: float) -> GemvPolicy:
    """An engine starts (the ModelRunner, from its Config): the process's policy becomes
    one of these settings, unless ``set_policy`` gave one (a test's or benchmark's, kept);
    the same settings as before keep the policy and its choices. Its trials get the whole
    budget again."""
    cache_path = cache_path_in(cache_dir)
    current = _policy
    replaceable = current is None or current.engine_made
    if replaceable and (
        current is None
        or (current.mode, current.cache_path, current.budget_s) != (mode, cache_path, budget_s)
    ):
        policy = GemvPolicy(mode, cache_path, budget_s)
        policy.engine_made = True
        _install(policy)
    _policy.start_engine()
    return _policy


def current_policy() -> GemvPolicy:
    """The process's policy: the one ``configure`` or ``set_policy`` gave; before either,
    the defaults without a cache file (layers run outside an engine)."""
    if _policy is None:
        policy = GemvPolicy()
        policy.engine_made = True  # the next engine replaces it
        _install(policy)
    return _policy


def set_policy(policy: GemvPolicy | None) -> GemvPolicy | None:
    """Replace the process's policy (tests, A/B benchmarks; an engine then keeps it);
    returns the previous one, which a caller may set back. None: the next engine makes its
    own from its Config again."""
    previous = _policy
    _install(policy)
    return previous


def use_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    silu_mul: bool = False,
    norm: bool = False,
    rope: RopeKV | None = None,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> bool:
    """Whether a fusion switch should run this layer as the Triton GEMV (the policy's
    choice for its shape at one row; ``rope``: with the RoPE + KV-write epilogue;
    ``bias``: the layer's bias, added in the GEMV's epilogue; ``weight_scale``: an FP8
    weight's scale per row)."""
    policy = current_policy()
    return policy.config_for(x, weight, silu_mul, norm, rope, bias, weight_scale) is not None
