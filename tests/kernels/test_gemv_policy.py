"""The batch-1 GEMV policy (atom/kernels/gemv_policy.py): which layer shapes run the Triton
GEMV, chosen by a timed trial against the unfused path, cached on disk.

On CPU the trial runs its candidates under the Triton interpreter (their outputs checked
against the unfused path's) with a made-up timer: each test sets the timings and checks
the choice, what the cache holds, and what the next policy reads from it."""

import json

import pytest
import torch

from atom.config import Config
from atom.kernels import gemv_policy, gemv_trial
from atom.kernels.gemv import gemv_reference, heuristic_config
from atom.kernels.gemv_policy import GemvPolicy, GemvPolicyError, GemvSite, candidates

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IN, ROWS = 64, 24  # few rows: a one-row tile runs a program per row under the interpreter


class FakeTimer:
    """Microseconds per call by candidate: the unfused path ``unfused_us``, a candidate
    its entry in ``fused_us`` (by tile) or ``other_us``, a norm site's 'norm kernel +
    plain GEMV' ``apart_us`` (by tile, else 50). Counts its calls (the norm-apart ones in
    ``apart_calls``)."""

    def __init__(self, unfused_us=10.0, fused_us=None, other_us=20.0, fail=False, apart_us=None):
        self.unfused_us, self.fused_us, self.other_us = unfused_us, fused_us or {}, other_us
        self.apart_us = apart_us or {}
        self.fail = fail
        self.calls, self.apart_calls = [], []

    def __call__(self, run, weights, calls, replays):
        if self.fail:
            raise RuntimeError("out of memory (made up)")
        if getattr(run, "apart", False):
            self.apart_calls.append(run.config)
            return self.apart_us.get(run.config, 50.0) * 1e-6
        self.calls.append(run.config)
        if run.config is None:
            return self.unfused_us * 1e-6
        return self.fused_us.get(run.config, self.other_us) * 1e-6


def _inputs(rows=ROWS, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, IN, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(rows, IN, generator=generator) / 8).to(DEVICE, dtype)
    return x, weight


def _policy(tmp_path, timer, **kwargs):
    return GemvPolicy("measure", str(tmp_path / "gemv_policy.json"), timer=timer,
                      rotation_bytes=0, **kwargs)  # fmt: skip


def _site(silu_mul=False, norm=False, rows=ROWS):
    return GemvSite(IN, rows, silu_mul, norm, "float32")


@pytest.mark.parametrize("silu_mul, norm", [(False, False), (True, False), (True, True)])
def test_the_fastest_candidate_wins_when_it_beats_the_unfused_path(tmp_path, silu_mul, norm):
    """The trial times the unfused path and every candidate once each and keeps the
    fastest candidate, which the GEMV then launches with (gemv_config reads it)."""
    site = _site(silu_mul, norm)
    tiles = candidates(site)
    assert len(tiles) >= 3 and heuristic_config(IN, ROWS, silu_mul) in tiles
    fastest = tiles[1]
    timer = FakeTimer(unfused_us=10.0, fused_us={fastest: 6.0, tiles[0]: 8.0})
    policy = _policy(tmp_path, timer)
    x, weight = _inputs()
    assert policy.config_for(x, weight, silu_mul, norm) == fastest
    assert sorted(map(str, timer.calls)) == sorted(map(str, [None, *tiles]))  # each once
    [record] = policy.report()
    assert record["choice"] == list(gemv_policy._label(fastest))
    assert record["source"] == "measured" and "1.67x" in record["reason"]
    assert policy.tile(site, x.device) == fastest
    # decided: asked again, nothing is timed again
    assert policy.config_for(x, weight, silu_mul, norm) == fastest
    assert len(timer.calls) == len(tiles) + 1


def test_a_norm_site_keeps_the_norm_apart_where_that_is_faster(tmp_path):
    """A norm site's fused norm must also beat the norm kernel followed by the plain
    Triton GEMV (what the layer runs when the norm site stays unfused): where the latter
    is faster, the norm site stays unfused, and the plain site decides its own GEMV
    (the MLP's gate_up + SiLU site, where this happens on the 1B shape)."""
    silu_mul = True
    site = _site(silu_mul, norm=True)
    plain = _site(silu_mul, norm=False)
    fused_tile, plain_tile = candidates(site)[1], candidates(plain)[0]
    timer = FakeTimer(unfused_us=10.0, fused_us={fused_tile: 8.0}, apart_us={plain_tile: 7.5})
    policy = _policy(tmp_path, timer)
    x, weight = _inputs()
    assert policy.config_for(x, weight, silu_mul, norm=True) is None  # 8.0 > 7.5 * 0.97
    assert sorted(map(str, timer.apart_calls)) == sorted(map(str, candidates(plain)))
    [record] = policy.report()
    assert record["choice"] == "unfused" and "norm apart" in record["reason"]
    [choice] = policy.choices.values()
    assert choice.candidates[("norm apart", *gemv_policy._label(plain_tile))] == 7.5
    # the plain site: its own trial, the Triton GEMV at 7.0 against 10.0
    timer.fused_us = {plain_tile: 7.0}
    assert policy.config_for(x, weight, silu_mul, norm=False) == plain_tile
    # the fused norm wins where it beats both by the margin
    timer = FakeTimer(unfused_us=10.0, fused_us={fused_tile: 6.0}, apart_us={plain_tile: 7.5})
    policy = _policy(tmp_path / "again", timer)
    assert policy.config_for(x, weight, silu_mul, norm=True) == fused_tile


def test_the_unfused_path_stays_unless_the_gemv_wins_by_the_margin(tmp_path):
    """A candidate faster by less than MARGIN, or slower, leaves the layer unfused; so
    does a layer of several rows (no trial) or another dtype than the weight's."""
    within = 10.0 * (1 - gemv_policy.MARGIN / 2)
    timer = FakeTimer(unfused_us=10.0, fused_us={}, other_us=within)
    policy = _policy(tmp_path, timer)
    x, weight = _inputs()
    assert policy.config_for(x, weight) is None
    [record] = policy.report()
    assert record["choice"] == "unfused" and record["unfused_us"] == 10.0
    assert "unfused: the best Triton tile" in record["reason"]
    calls = len(timer.calls)
    assert policy.config_for(torch.cat([x, x]), weight) is None  # two rows: cuBLAS
    assert policy.config_for(x.double(), weight) is None  # dtypes differ
    assert len(timer.calls) == calls


def test_a_candidate_that_computes_something_else_never_wins(tmp_path, monkeypatch):
    """A candidate whose output differs from the unfused path's is not timed and cannot be
    chosen, however fast the timer says it would be."""
    site = _site()
    tiles = candidates(site)
    broken = tiles[0]
    real_fused = gemv_trial.TrialInputs.fused

    def fused(self, config):
        run = real_fused(self, config)
        if config != broken:
            return run

        def wrong(weight):
            return run(weight) + 1.0

        wrong.config = config
        return wrong

    monkeypatch.setattr(gemv_trial.TrialInputs, "fused", fused)
    timer = FakeTimer(unfused_us=10.0, fused_us={broken: 1.0, tiles[1]: 5.0})
    policy = _policy(tmp_path, timer)
    x, weight = _inputs()
    assert policy.config_for(x, weight) == tiles[1]
    assert broken not in timer.calls


def test_the_cache_is_read_by_the_next_start_per_key(tmp_path):
    """A choice is written under its full key; a new policy (the next start) reads it
    without timing anything; another shape, dtype or PDL setting is another key."""
    x, weight = _inputs()
    fastest = candidates(_site())[2]
    first = _policy(tmp_path, FakeTimer(fused_us={fastest: 4.0}))
    assert first.config_for(x, weight) == fastest
    data = json.loads((tmp_path / "gemv_policy.json").read_text())
    assert data["version"] == gemv_policy.CACHE_VERSION
    [(name, entry)] = data["entries"].items()
    assert entry["choice"] == list(gemv_policy._label(fastest))
    assert name == GemvPolicy.key_string(tuple(entry["key"]))
    assert entry["key"][1] == gemv_policy._triton_version() and entry["key"][3:5] == [IN, ROWS]

    second_timer = FakeTimer(fail=True)  # timing anything would fail the trial
    second = _policy(tmp_path, second_timer)
    assert second.config_for(x, weight) == fastest
    assert second.report()[0]["source"] == "cached" and second_timer.calls == []
    # another shape (more rows) is measured: the timer fails, so it stays unfused
    other_x, other_weight = _inputs(rows=ROWS + 16)
    assert second.config_for(other_x, other_weight) is None
    assert "trial failed" in second.report()[1]["reason"]


def _write_entry(tmp_path, key, **changes):
    entry = dict(key=list(key), choice=[1, 64, 2, 1], reason="made up", unfused_us=10.0,
                 fused_us=1.0, candidates={})  # fmt: skip
    name = changes.pop("name", GemvPolicy.key_string(key))
    entry.update(changes)
    path = tmp_path / "gemv_policy.json"
    path.write_text(json.dumps(dict(version=gemv_policy.CACHE_VERSION, entries={name: entry})))


@pytest.mark.parametrize(
    "changes",
    [
        dict(choice=[3, 64, 2, 1]),  # BLOCK_N 3: no tile of ours
        dict(choice=[1, 64, 2]),
        dict(choice="fastest"),
        dict(unfused_us=-1.0),
        dict(unfused_us="10"),
        dict(stale_triton=True),  # the entry of another Triton version
        dict(stale_gpu=True),  # of another GPU
        dict(name_mismatch=True),  # its name says this key, its key field another
    ],
)
def test_a_corrupt_or_stale_entry_is_measured_again(tmp_path, changes):
    """An entry that cannot be one of ours, or one of another GPU / Triton version, is
    never trusted: the site is measured, and the file then holds the measured choice."""
    x, weight = _inputs()
    probe = _policy(tmp_path / "probe", FakeTimer())
    key = probe._key(_site(), x.device)
    stale = list(key)
    if changes.pop("stale_triton", False):
        stale[1] = "0.0.1"
    if changes.pop("stale_gpu", False):
        stale[0] = "another GPU"
    if changes.pop("name_mismatch", False):
        stale[4] = ROWS * 2
        changes["name"] = GemvPolicy.key_string(key)
    _write_entry(tmp_path, tuple(stale), **changes)
    fastest = candidates(_site())[0]
    timer = FakeTimer(fused_us={fastest: 5.0})
    policy = _policy(tmp_path, timer)
    assert policy.config_for(x, weight) == fastest
    assert policy.report()[0]["source"] == "measured" and timer.calls
    entries = json.loads((tmp_path / "gemv_policy.json").read_text())["entries"]
    assert entries[GemvPolicy.key_string(key)]["choice"] == list(gemv_policy._label(fastest))


@pytest.mark.parametrize("content", ["{not json", json.dumps(dict(version=99, entries={}))])
def test_an_unreadable_or_other_version_file_is_ignored_and_rewritten(tmp_path, content):
    (tmp_path / "gemv_policy.json").write_text(content)
    x, weight = _inputs()
    policy = _policy(tmp_path, FakeTimer(fused_us={}, other_us=20.0))
    assert policy.config_for(x, weight) is None
    data = json.loads((tmp_path / "gemv_policy.json").read_text())
    assert data["version"] == gemv_policy.CACHE_VERSION and len(data["entries"]) == 1


def test_fallbacks_keep_the_unfused_path(tmp_path):
    """No CUDA (and no timer), a failed trial, a spent budget: the unfused path; none of
    these is cached (the next start measures again)."""
    x, weight = _inputs()
    if not x.is_cuda:
        no_cuda = GemvPolicy("measure", str(tmp_path / "a.json"))
        assert no_cuda.config_for(x, weight) is None
        assert no_cuda.report()[0]["source"] == "fallback"
        assert "no CUDA" in no_cuda.report()[0]["reason"]
    failing = _policy(tmp_path, FakeTimer(fail=True))
    assert failing.config_for(x, weight) is None
    assert "trial failed" in failing.report()[0]["reason"]
    spent = _policy(tmp_path, FakeTimer(fused_us={candidates(_site())[0]: 1.0}), budget_s=0.0)
    assert spent.config_for(x, weight) is None
    assert "budget" in spent.report()[0]["reason"]
    assert not (tmp_path / "gemv_policy.json").exists()


def test_forced_modes_and_environment(monkeypatch, tmp_path):
    x, weight = _inputs()
    fused = GemvPolicy("fused", None)
    assert fused.config_for(x, weight, silu_mul=True) == heuristic_config(IN, ROWS, True)
    assert GemvPolicy("unfused", None).config_for(x, weight) is None
    with pytest.raises(GemvPolicyError, match="sometimes"):
        GemvPolicy("sometimes")
    monkeypatch.setenv("ATOM_GEMV_POLICY", "sometimes")
    with pytest.raises(ValueError, match="ATOM_GEMV_POLICY"):
        Config(device="cpu")
    with pytest.raises(ValueError, match="gemv_policy"):
        Config(device="cpu", gemv_policy="sometimes")
    monkeypatch.setenv("ATOM_GEMV_POLICY", "unfused")
    monkeypatch.setenv("ATOM_GEMV_TRIAL_BUDGET_S", "a while")
    with pytest.raises(ValueError, match="ATOM_GEMV_TRIAL_BUDGET_S"):
        Config(device="cpu")
    monkeypatch.setenv("ATOM_GEMV_TRIAL_BUDGET_S", "0.5")
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path))
    config = Config(device="cpu")
    assert (config.gemv_policy, config.gemv_trial_budget_s) == ("unfused", 0.5)
    assert config.cache_dir == str(tmp_path)
    previous = gemv_policy.set_policy(None)  # the engine's own, from its Config
    try:
        policy = gemv_policy.configure(config.gemv_policy, config.cache_dir, 0.5)
        assert policy.mode == "unfused" and policy.budget_s == 0.5
        assert policy.cache_path == str(tmp_path / "gemv_policy.json")
        assert gemv_policy.current_policy() is policy
        assert gemv_policy.configure("unfused", config.cache_dir, 0.5) is policy  # kept
        assert not gemv_policy.use_gemv(x, weight)
        mine = GemvPolicy("fused", None)
        gemv_policy.set_policy(mine)  # a test's or benchmark's: the engine keeps it
        assert gemv_policy.configure("unfused", config.cache_dir, 0.5) is mine
        gemv_policy.set_policy(policy)  # an engine's policy set back: the next engine's again
        assert gemv_policy.configure("fused", None, 0.5) is not policy
        assert gemv_policy.current_policy().mode == "fused"
    finally:
        gemv_policy.set_policy(previous)


def test_the_chosen_tile_computes_the_layer(tmp_path):
    """The GEMV launched with the policy's tile (gemv_config's source) gives F.linear."""
    from atom.kernels.gemv import gemv

    x, weight = _inputs()
    fastest = candidates(_site())[1]
    policy = _policy(tmp_path, FakeTimer(fused_us={fastest: 2.0}))
    previous = gemv_policy.set_policy(policy)
    try:
        assert gemv_policy.use_gemv(x, weight)
        torch.testing.assert_close(gemv(x, weight), gemv_reference(x, weight), atol=1e-4, rtol=1e-4)
    finally:
        gemv_policy.set_policy(previous)


@pytest.mark.gpu
def test_the_trial_compiles_each_candidate_once_on_gpu(tmp_path):
    """A real trial (CUDA graphs, bf16, a shape outside the benchmark matrix): each
    candidate tile is one compiled variant of the kernel, and running the chosen tile at
    one row, then more rows (the torch path), adds none."""
    from atom.kernels import gemv as gemv_module
    from tests.kernels.recompile_guard import compiled_variants, swapped_kernels

    x = torch.randn(4, 896, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2 * 4864, 896, device="cuda", dtype=torch.bfloat16) / 30
    policy = GemvPolicy("measure", str(tmp_path / "gemv_policy.json"))
    site = GemvSite(896, 2 * 4864, True, False, "bfloat16")
    previous = gemv_policy.set_policy(policy)
    try:
        with swapped_kernels(gemv_module, ["_gemv_row_kernel"]) as copies:
            kernel = copies["_gemv_row_kernel"]
            config = policy.config_for(x[:1], weight, silu_mul=True)
            assert compiled_variants(kernel) == len(candidates(site))
            for rows in (1, 1, 2, 3, 1):
                gemv_module.gemv_silu_and_mul(x[:rows], weight)
            torch.cuda.synchronize()
            assert compiled_variants(kernel) == len(candidates(site))
    finally:
        gemv_policy.set_policy(previous)
    [record] = policy.report()
    assert record["unfused_us"] > 0 and (config is None) == (record["choice"] == "unfused")


def test_a_rope_site_is_its_own_key_and_its_trial_writes_no_cache(tmp_path):
    """The qkv GEMV with the RoPE + KV-write epilogue is measured against the GEMV and
    rotary_kv_write (outputs compared on q), as a site of its own; the trial never writes
    the step's cache slot."""
    from atom.kernels.gemv_rope_kv import RopeKV

    heads, kv_heads, head_dim = 2, 1, 16
    rows = (heads + 2 * kv_heads) * head_dim
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(1, IN, generator=generator).to(DEVICE)
    weight = (torch.randn(rows, IN, generator=generator) / 8).to(DEVICE)
    angles = torch.arange(32.0)[:, None] * torch.linspace(0.1, 1.0, head_dim // 2)[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=1).to(DEVICE)
    sin = torch.cat([angles.sin(), angles.sin()], dim=1).to(DEVICE)
    k_cache = torch.randn(2, 16, kv_heads, head_dim, generator=generator).to(DEVICE)
    v_cache = torch.randn(2, 16, kv_heads, head_dim, generator=generator).to(DEVICE)
    before = (k_cache.clone(), v_cache.clone())
    slot = torch.tensor([5], device=DEVICE)
    rope = RopeKV(torch.tensor([7], device=DEVICE), cos, sin, k_cache, v_cache, slot, heads,
                  kv_heads, head_dim)  # fmt: skip
    site = GemvSite(IN, rows, False, True, "float32", rope=True)
    fastest = candidates(site)[0]
    timer = FakeTimer(unfused_us=10.0, fused_us={fastest: 5.0})
    policy = _policy(tmp_path, timer)
    assert policy.config_for(x, weight, norm=True, rope=rope) == fastest
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    assert fastest in timer.calls  # its q matched the unfused path's
    assert policy.report()[0]["site"] == site.label() and "rope_kv" in site.label()
    # the same weight without the epilogue is another site, measured on its own
    policy.timer = FakeTimer(unfused_us=10.0, other_us=12.0)
    assert policy.config_for(x, weight, norm=True) is None
    assert len(policy.report()) == 2


def test_a_bias_site_is_its_own_site_and_its_trial_adds_the_bias(tmp_path):
    """A layer with a bias (Qwen2's qkv) is decided apart from the same shape without one
    (another key; the report says 'bias'), and its trial's two paths add a bias: the fused
    candidates are checked against F.linear with it (a candidate that dropped it would
    never match). A bias the kernel cannot take (another dtype, before the SiLU) keeps the
    unfused path without a trial."""
    site = _site()
    fastest = candidates(site)[0]
    timer = FakeTimer(unfused_us=10.0, fused_us={fastest: 6.0})
    policy = _policy(tmp_path, timer)
    x, weight = _inputs()
    bias = torch.randn(ROWS, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert policy.config_for(x, weight, bias=bias) == fastest
    assert policy.config_for(x, weight) == fastest  # the plain site: a trial of its own
    assert len(timer.calls) == 2 * (len(candidates(site)) + 1)
    labels = sorted(record["site"] for record in policy.report())
    assert labels == [f"{IN}x{ROWS} float32", f"{IN}x{ROWS}+bias float32"]
    inputs = gemv_trial.TrialInputs(GemvSite(IN, ROWS, False, False, "float32", bias=True), weight)
    expected = torch.nn.functional.linear(inputs.x, weight, inputs.bias)
    torch.testing.assert_close(inputs.unfused()(weight), expected)
    torch.testing.assert_close(inputs.fused(fastest)(weight), expected, atol=1e-4, rtol=1e-4)
    calls = len(timer.calls)
    assert policy.config_for(x, weight, bias=bias.double()) is None
    assert policy.config_for(x, torch.cat([weight, weight]), silu_mul=True, bias=bias) is None
    assert len(timer.calls) == calls
    # the next start reads the bias site's choice from the cache
    again = _policy(tmp_path, FakeTimer(fail=True))
    assert again.config_for(x, weight, bias=bias) == fastest
    assert again.report()[0]["source"] == "cached"


def _fp8_inputs(rows=ROWS):
    """x (fp32), an e4m3 weight [rows, IN] with one float32 scale per row, and the same
    weight dequantized (a dense layer of the same shape)."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(1, IN, generator=generator).to(DEVICE)
    weight = torch.randn(rows, IN, generator=generator) / 8
    scale = weight.abs().amax(dim=1, keepdim=True) / 448
    fp8 = (weight / scale).to(torch.float8_e4m3fn)
    return x, fp8.to(DEVICE), scale.to(DEVICE), (fp8.float() * scale).to(DEVICE)


@pytest.mark.parametrize("silu_mul, norm", [(False, True), (True, True), (True, False)])
def test_an_fp8_site_is_its_own_key_against_the_fp8_linear(tmp_path, monkeypatch, silu_mul, norm):
    """An FP8 layer (one scale per row) is decided apart from a dense layer of its shape
    (the weight dtype in the key and the report); its unfused path is the FP8 linear of
    atom/kernels/fp8_linear.py (what Fp8LinearMethod runs), its candidates read twice the
    inputs per chunk, and a norm site of qkv (no SiLU) has no 'norm apart' way: its plain
    layer is the FP8 linear. The next start reads the FP8 choice from the cache."""
    unfused_calls = []
    real_fp8_linear = gemv_trial.fp8_linear
    monkeypatch.setattr(
        gemv_trial,
        "fp8_linear",
        lambda *a, **k: unfused_calls.append(a) or real_fp8_linear(*a, **k),
    )
    site = GemvSite(IN, ROWS, silu_mul, norm, "float32", weight_dtype="float8_e4m3fn")
    tiles = candidates(site)
    assert heuristic_config(IN, ROWS, silu_mul, "float8_e4m3fn") in tiles
    dense_tiles = candidates(_site(silu_mul, norm))
    assert max(t.block_k for t in tiles) >= max(t.block_k for t in dense_tiles)
    fastest = tiles[0]
    timer = FakeTimer(unfused_us=10.0, fused_us={fastest: 6.0})
    policy = _policy(tmp_path, timer)
    x, fp8, scale, dequantized = _fp8_inputs()
    assert policy.config_for(x, fp8, silu_mul, norm, weight_scale=scale) == fastest
    assert unfused_calls, "the unfused path of an FP8 site is the FP8 linear"
    assert fastest in timer.calls  # its output matched the FP8 linear's
    assert bool(timer.apart_calls) == (norm and silu_mul)  # qkv: no norm-apart way
    assert policy.tile(site, x.device) == fastest
    assert policy.config_for(x, fp8, silu_mul, norm) is None  # no scale: not a weight of x's dtype
    assert policy.config_for(x, fp8, silu_mul, norm, weight_scale=scale[:, :0]) is None
    # the dense layer of the same shape: a trial and an entry of its own
    policy.timer = FakeTimer(unfused_us=10.0, other_us=12.0)
    assert policy.config_for(x, dequantized, silu_mul, norm) is None
    labels = sorted(record["site"] for record in policy.report())
    assert labels == sorted([site.label(), _site(silu_mul, norm).label()])
    assert "float8_e4m3fn weight" in site.label()
    data = json.loads((tmp_path / "gemv_policy.json").read_text())
    assert sorted(str(entry["key"][-1]) for entry in data["entries"].values()) == [
        "None", "float8_e4m3fn",
    ]  # fmt: skip
    again = _policy(tmp_path, FakeTimer(fail=True))
    assert again.config_for(x, fp8, silu_mul, norm, weight_scale=scale) == fastest
    assert again.report()[0]["source"] == "cached"
    fused = GemvPolicy("fused")
    expected = heuristic_config(IN, ROWS, silu_mul, "float8_e4m3fn")
    assert fused.config_for(x, fp8, silu_mul, norm, weight_scale=scale) == expected
