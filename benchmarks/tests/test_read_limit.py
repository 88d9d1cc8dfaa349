"""benchmarks.harness's decode read: the bytes a decode step reads, against hand counts."""

import pytest
import torch
from torch import nn

from benchmarks.harness import decode_weight_bytes, expected_experts, read_limit


class Tiny(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 8)  # 800 values
        self.proj = nn.Linear(8, 16, bias=False)  # 128
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(4, 6, 8))  # 4 experts x 48
        self.lm_head = nn.Linear(8, 100, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


def test_expected_experts_one_row_and_many():
    assert expected_experts(1, 6, 16) == pytest.approx(6)
    assert expected_experts(2, 1, 4) == pytest.approx(4 * (1 - 0.75**2))
    assert expected_experts(64, 6, 16) == pytest.approx(16, rel=1e-6)


def test_weight_bytes_count_one_embedding_row_and_the_routed_experts():
    model = Tiny(tied=False).to(torch.bfloat16)
    # untied: one embedding row (8), proj 128, one of 4 experts (48), LM head 800
    assert decode_weight_bytes(model, 1, 1, 4) == pytest.approx(2 * (8 + 128 + 48 + 800))
    # tied: the table is read whole as the LM head
    tied = Tiny(tied=True).float()
    assert decode_weight_bytes(tied, 1, 1, 4) == pytest.approx(4 * (800 + 128 + 48))


def test_read_limit_fields():
    limit = read_limit(3e9, 1e9, 4e12)
    assert limit == dict(read_mb=4000.0, weight_mb=3000.0, state_mb=1000.0, limit_ms=1.0)
    assert "limit_ms" not in read_limit(1.0, 0.0, None)
