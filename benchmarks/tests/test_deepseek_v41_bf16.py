"""benchmarks/deepseek_v41_bf16.py on the CPU, where the answers are known: fp32 on the CPU
path against the fp32 CPU reference agrees everywhere (agreement 1, regret 0, logit error 0:
the same computation); each variant puts its attention in the engine's place and takes it
out again (the CUDA path's prefill under the interpreter is the parity tests')."""

import os

import pytest
import torch

from atom.kernels.v4_prefill_attention import v4_prefill_attention_reference
from benchmarks import deepseek_v41_bf16 as bench

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(bench.REFERENCE, "tiny-minimal", "golden.json")),
    reason="needs ../shared/reference/deepseek_v41 beside the checkout",
)


def test_fp32_on_the_cpu_path_agrees_exactly():
    rows = bench.run(["tiny-minimal"], ["dense", "reference"], "cpu", "float32", 3, prompts=2)
    assert [r["variant"] for r in rows] == ["dense", "reference"]
    for row in rows:
        assert row["greedy_agreement"] == 1.0 and row["worst_regret"] == 0.0, row
        assert row["tf_max_err"] == 0.0 and row["tf_argmax_flips"] == 0, row
        assert row["positions"] == 2 * 3


@pytest.mark.parametrize("variant", ["dense", "reference", "triton16", "triton64"])
def test_a_variant_switches_the_prefill_attention_and_undoes(variant):
    """Each variant attends as the reference does (the kernel under the interpreter, its
    own tile width) while on, and the engine's own choice comes back after."""
    import atom.attention.v4 as v4
    import atom.attention.v41 as v41
    from tests.kernels.test_v4_prefill import _case

    args = _case("cpu", torch.float32, 8, 37, 19, 4, 4, 32, "chosen")
    expected = v4_prefill_attention_reference(*args)
    before = v4.PREFILL_ATTENTION, v41.v4_prefill_attention
    undo = bench.use_variant(variant)
    if variant == "dense":
        assert v4.PREFILL_ATTENTION == "torch" and v41.v4_prefill_attention is before[1]
    else:
        assert v4.PREFILL_ATTENTION == before[0]
        torch.testing.assert_close(v41.v4_prefill_attention(*args), expected)
    undo()
    assert (v4.PREFILL_ATTENTION, v41.v4_prefill_attention) == before


def test_an_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown 'triton'"):
        bench.use_variant("triton")


def test_the_measure_is_the_parity_tests():
    """The benchmark's agreement and regret are the GPU parity test's on the same tokens
    (tests/model_engine/test_deepseek_v41_parity.py keeps its own copy: tests import no
    benchmark): golden tokens with one position of every prompt changed."""
    from tests.model_engine import test_deepseek_v41_parity as parity

    prompts = parity.PROMPTS[:2]
    outputs = [tokens[:4] for tokens in parity._expected(parity.MINIMAL, 4)[:2]]
    outputs[0][1] = (outputs[0][1] + 7) % 256
    outputs[1][3] = (outputs[1][3] + 1) % 256
    expected = parity.fp32_agreement_and_regret("tiny-minimal", prompts, outputs)
    got = bench.agreement_and_regret(bench.build("tiny-minimal"), prompts, outputs)
    assert got == expected
    assert expected[0] < 1.0 and expected[1] > 0.0  # the changed positions count
