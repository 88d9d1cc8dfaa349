"""Speculative decoding: proposers guess the next tokens, one target forward verifies them.

- `proposers.py`: the Proposer interface and the n-gram (prompt lookup) proposer;
- `draft_model.py`: a smaller model with the same vocabulary proposes, on its own runner
  (own KV cache tensors addressed by the target's block ids, own runner slot);
- `draft_runner.py`: that runner, a ModelRunner whose launches alternate two slots and
  whose catch-up steps replay multi-token graphs;
- `verify.py`: greedy acceptance and rejection sampling of the verified rows (device);
- `decoder.py`: what the engine calls: lookahead for the scheduler, proposals before the
  launch, acceptance and KV rollback after it, and the counters /metrics reads.

See docs/speculative_decoding.md.
"""
