"""The CPU runner packs its linear layers' weights for oneDNN by default and leaves them
dense with cpu_linear="dense" (atom/kernels/cpu_linear.py); both give the same greedy tokens
on the tiny Llama (test_parity_tiny.py covers the default on every tiny family)."""

from atom.sampling_params import SamplingParams
from tests.engine_support import build_llm, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _packed(llm) -> list[bool]:
    model = llm.engine.model_runner.model
    return [hasattr(p, "cpu_packed") for p in model.parameters() if p.dim() == 2]


def test_packed_by_default_dense_on_request(tiny_model_dirs, monkeypatch):
    monkeypatch.delenv("ATOM_CPU_LINEAR", raising=False)
    prompts = random_prompts(0, [5, 17])
    packed = build_llm(tiny_model_dirs["llama"])
    dense = build_llm(tiny_model_dirs["llama"], cpu_linear="dense")
    assert any(_packed(packed)) and not any(_packed(dense))
    assert [o.token_ids for o in packed.generate(prompts, GREEDY, use_tqdm=False)] == [
        o.token_ids for o in dense.generate(prompts, GREEDY, use_tqdm=False)
    ]
