"""Speculative decoding on families with per-sequence state (issue 28, item 1), CPU fp32.

DeepSeek-V4 (window rings, compressor rows), DeepSeek-V4.1 (the same and the Engram
history) and Qwen3-Next (GDN conv and delta-rule states) write their state rows in place
for every token of a verify step, drafts included; rejected drafts roll back by state
snapshot (atom/model_engine/speculative/state_rollback.py). Greedy outputs must equal HF
transformers' greedy `generate` (V4, Qwen3-Next) or, for V4.1, the engine's own output
without speculation and the upstream reference's golden tokens, with:
- the issue's reproducer shapes: V4 with sliding-window layers only (3 layers, window 8,
  hc_mult 2), Qwen3-Next [linear, full, linear], prompts of 12-90 tokens, two of them
  repetitive, num_speculative_tokens 4, ngram_min 1;
- the n-gram and the draft-model proposer (a tiny Llama with the target's vocabulary), and
  a proposer that replays the reference with one wrong draft at a varying position, so
  that every number of kept drafts occurs (0 to 3 with a rollback, 4 without);
- chunked prefill (a step budget of 7 tokens: drafts cut short, verify rows beside prefill
  chunks), preemption (a tiny KV cache) and packed publication.
Each run also checks that drafts were proposed and rejected and states restored (the
counters), so that it cannot pass without exercising the rollback.
"""

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM") or not hasattr(
    transformers, "Qwen3NextForCausalLM"
):
    pytest.skip("transformers without DeepSeek-V4 or Qwen3-Next", allow_module_level=True)

from atom.attention.backend import POSITIONS, STATE_SNAPSHOT, MHABackend  # noqa: E402
from atom.attention.gdn import GDNBackend  # noqa: E402
from atom.attention.v4 import V4Backend  # noqa: E402
from atom.attention.v41 import V41Backend  # noqa: E402
from atom.sampling_params import SamplingParams  # noqa: E402
from tests.engine_support import build_llm, hf_greedy_no_eos, vocab_prompts  # noqa: E402
from tests.model_engine.test_deepseek_v4_parity import COMMON as V4_COMMON  # noqa: E402
from tests.model_engine.test_deepseek_v4_parity import VARIANTS as V4_VARIANTS  # noqa: E402
from tests.model_engine.test_qwen3_next_parity import COMMON as QWEN_COMMON  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "deepseek_v41"
VOCAB = 320  # the V4 and Qwen3-Next tiny configs; V4.1's reference models have 256
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1)
SWA = "sliding_attention"
LIN, FULL = "linear_attention", "full_attention"


def prompts_for(vocab: int) -> list[list[int]]:
    """12-90 tokens: two random, two that repeat a short pattern (the n-gram proposer
    matches them and is often wrong about what the model continues with)."""
    random = vocab_prompts(28, [12, 47], vocab)
    return random + [[11, 12, 13, 14, 15] * 6, ([40, 41, 42, 43, 44, 45, 46] * 13)[:90]]


PROMPTS = prompts_for(VOCAB)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops: one intra-op thread (a loaded 2-core host spins otherwise)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _randomise(model, names_normal, names_uniform=()):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(names_normal):
                param.normal_(0.0, 0.5 if "sinks" in name or "bias" in name else 0.3)
            elif names_uniform and name.endswith(names_uniform):
                param.uniform_(-1.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The issue's reproducers, V4 with every layer type, and draft Llamas per vocabulary."""
    root = tmp_path_factory.mktemp("speculative_state")
    dirs = {}
    torch.manual_seed(28)
    v4_swa = dict(
        num_hidden_layers=3, layer_types=[SWA] * 3, mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates=V4_VARIANTS["a"]["compress_rates"], sliding_window=8, hc_mult=2,
        index_topk=3,
    )  # fmt: skip
    for name, shape in (("v4_swa", v4_swa), ("v4_all", V4_VARIANTS["a"])):
        config = transformers.DeepseekV4Config(**V4_COMMON, **shape)
        model = transformers.DeepseekV4ForCausalLM(config)
        _randomise(model, ("sinks", "position_bias", ".base", "hc_base"))
        with torch.no_grad():
            for buffer_name, buffer in model.named_buffers():
                if buffer_name.endswith("tid2eid"):
                    rows = [torch.randperm(4)[:2] for _ in range(buffer.shape[0])]
                    buffer.copy_(torch.stack(rows))
        model.save_pretrained(root / name)
        dirs[name] = str(root / name)
    config = transformers.Qwen3NextConfig(
        **QWEN_COMMON, num_hidden_layers=3, layer_types=[LIN, FULL, LIN], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    )  # fmt: skip
    model = transformers.Qwen3NextForCausalLM(config)
    _randomise(model, ("norm.weight", "dt_bias", "gate.weight"), ("A_log",))
    model.save_pretrained(root / "qwen3_next")
    dirs["qwen3_next"] = str(root / "qwen3_next")
    for vocab in (VOCAB, 256):
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
            initializer_range=0.3, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        transformers.LlamaForCausalLM(config).save_pretrained(root / f"draft{vocab}")
        dirs[f"draft{vocab}"] = str(root / f"draft{vocab}")
    return dirs


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_rolled_back(llm):
    """Drafts were proposed and some rejected; state rows were saved and restored."""
    stats = llm.engine.speculator.stats
    snapshots = llm.engine.model_runner.state_snapshots
    assert stats.proposed_tokens > stats.accepted_tokens
    assert stats.state_restores > 0 and snapshots.restored == stats.state_restores
    assert snapshots.saved >= stats.num_drafts


class OneWrongDraft:
    """Proposes the reference continuation with draft `j` wrong, j cycling over 0..k from
    call to call (j = k: every draft right), so every number of kept drafts occurs."""

    def __init__(self, prompts, references, k: int):
        self.references = {tuple(p): r for p, r in zip(prompts, references, strict=True)}
        self.k = k
        self._pending: dict[int, list[int]] = {}
        self.calls = 0
        self.kept: list[tuple[int, int]] = []  # (drafts, kept) per verified sequence-step

    def lookahead(self, seq, limit: int) -> int:
        known = self.references[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        proposal = list(known[seq.num_output_tokens : seq.num_output_tokens + limit])
        wrong = self.calls % (self.k + 1)
        self.calls += 1
        if wrong < len(proposal):
            proposal[wrong] = (proposal[wrong] + 1) % VOCAB
        self._pending[seq.seq_id] = proposal
        return len(proposal)

    def may_propose(self, seq) -> bool:
        return True

    def propose(self, seqs, counts):
        return [self._pending.pop(s.seq_id, [])[:c] for s, c in zip(seqs, counts, strict=True)]

    def on_verified(self, seq, position, num_drafts, num_accepted):
        self.kept.append((num_drafts, num_accepted))


# -- the declaration ------------------------------------------------------------------------


def test_families_declare_their_rollback():
    assert MHABackend.speculation.rollback == POSITIONS and MHABackend.speculation.verify_graphs
    for backend in (V4Backend, V41Backend):  # multi-token steps read the host: eager
        assert backend.speculation.rollback == STATE_SNAPSHOT
        assert not backend.speculation.verify_graphs
    gdn = GDNBackend.speculation
    assert gdn.rollback == STATE_SNAPSHOT and gdn.verify_graphs


# -- DeepSeek-V4 ----------------------------------------------------------------------------


def test_v4_sliding_window_ngram_matches_hf(model_dirs):
    """The issue's reproducer: before the fix every prompt left HF's tokens."""
    path = model_dirs["v4_swa"]
    llm = build_llm(path, num_kvcache_blocks=64, max_model_len=256, **SPEC)
    assert _tokens(llm) == hf_greedy_no_eos(path, PROMPTS, MAX_TOKENS)
    _assert_rolled_back(llm)


def test_v4_draft_model_chunked_prefill_packed_matches_hf(model_dirs):
    path = model_dirs["v4_swa"]
    llm = build_llm(
        path, num_kvcache_blocks=64, max_model_len=256, max_num_batched_tokens=7,
        h2d_backend="packed", speculative_method="draft", speculative_model=model_dirs["draft320"],
    )  # fmt: skip
    assert _tokens(llm) == hf_greedy_no_eos(path, PROMPTS, MAX_TOKENS)
    _assert_rolled_back(llm)


def test_v4_every_layer_type_preemption_matches_hf(model_dirs):
    """Compressor partial rows (CSA overlap, HCA) and the indexer's, with preemption:
    the paged entries and keys are rewritten by the recompute, the state comes back."""
    path = model_dirs["v4_all"]
    llm = build_llm(path, num_kvcache_blocks=12, max_num_seqs=4, max_model_len=144, **SPEC)
    assert _tokens(llm) == hf_greedy_no_eos(path, PROMPTS, MAX_TOKENS)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_rolled_back(llm)


@pytest.mark.parametrize("kind", ["v4_swa", "v4_all", "qwen3_next"])
def test_every_number_of_kept_drafts_matches_hf(model_dirs, kind):
    """Kept 0..3 of 4 (rolled back: the kept drafts and the bonus token are recomputed) and
    4 of 4 (nothing rolled back: the state as the verify step wrote it)."""
    path = model_dirs[kind]
    reference = hf_greedy_no_eos(path, PROMPTS, MAX_TOKENS)
    llm = build_llm(path, num_kvcache_blocks=64, max_model_len=256, **SPEC)
    proposer = OneWrongDraft(PROMPTS, reference, 4)
    llm.engine.speculator.proposer = proposer
    assert _tokens(llm) == reference
    kept = {a for d, a in proposer.kept if d == 4}
    assert kept == {0, 1, 2, 3, 4}, kept
    stats = llm.engine.speculator.stats
    assert stats.state_restores == sum(1 for d, a in proposer.kept if a < d)


# -- Qwen3-Next -----------------------------------------------------------------------------


def test_qwen3_next_ngram_packed_matches_hf(model_dirs):
    path = model_dirs["qwen3_next"]
    llm = build_llm(path, num_kvcache_blocks=64, max_model_len=256, h2d_backend="packed", **SPEC)
    assert _tokens(llm) == hf_greedy_no_eos(path, PROMPTS, MAX_TOKENS)
    _assert_rolled_back(llm)


def test_qwen3_next_draft_model_chunked_prefill_and_preemption_match_hf(model_dirs):
    path = model_dirs["qwen3_next"]
    llm = build_llm(
        path, num_kvcache_blocks=9, max_num_seqs=4, max_model_len=144, max_num_batched_tokens=16,
        speculative_method="draft", speculative_model=model_dirs["draft320"],
    )  # fmt: skip
    assert _tokens(llm) == hf_greedy_no_eos(path, PROMPTS, MAX_TOKENS)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_rolled_back(llm)


# -- DeepSeek-V4.1 (the upstream reference's checkpoints) ----------------------------------

V41_PROMPTS = prompts_for(256)


def _v41(name, **kwargs):
    if not (REFERENCE / name / "golden.json").is_file():
        pytest.skip(f"no DeepSeek-V4.1 reference data at {REFERENCE}")
    kwargs.setdefault("num_kvcache_blocks", 64)
    kwargs.setdefault("max_model_len", 144)
    return build_llm(str(REFERENCE / name), skip_tokenizer_init=True, **kwargs)


def _golden(name):
    import json

    record = json.loads((REFERENCE / name / "golden.json").read_text())
    prompts = [p["prompt_ids"] for p in record["prompts"]]
    return prompts, [p["greedy_continuation"] for p in record["prompts"]]


@pytest.mark.parametrize(
    "name, options",
    [
        ("tiny-full", dict(SPEC, max_num_batched_tokens=7, num_kvcache_blocks=12, max_num_seqs=4)),
        ("tiny-minimal", dict(speculative_method="draft", h2d_backend="packed")),
    ],
    ids=["full-ngram-chunked-preempted", "minimal-draft-packed"],
)
def test_v41_matches_plain_and_golden(model_dirs, name, options):
    """tiny-full (Engram history, fake quantisation, two-level top-k) with the n-gram
    proposer, chunked prefill and preemption; tiny-minimal with the draft model and packed
    publication: the tokens without speculation, and the golden continuations."""
    if options.get("speculative_method") == "draft":
        options = dict(options, speculative_model=model_dirs["draft256"])
    plain = _v41(name)
    want = _tokens(plain, V41_PROMPTS)
    golden_prompts, golden = _golden(name)
    llm = _v41(name, **options)
    assert _tokens(llm, V41_PROMPTS) == want
    _assert_rolled_back(llm)
    if name == "tiny-full":
        assert llm.engine.scheduler.num_preemptions > 0
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert _tokens(llm, golden_prompts, params) == golden


# -- refusals -------------------------------------------------------------------------------


def test_a_stateful_draft_model_is_refused(model_dirs):
    """The draft's KV is rolled back by position (it shares the target's block ids): a
    draft with per-sequence state is refused at start, naming the setting."""
    with pytest.raises(ValueError, match="speculative_model .*qwen3_next.*speculative_method"):
        build_llm(
            model_dirs["qwen3_next"], num_kvcache_blocks=16, speculative_method="draft",
            speculative_model=model_dirs["qwen3_next"],
        )  # fmt: skip
