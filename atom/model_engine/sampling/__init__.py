"""Sampling: from a step's logits to its tokens and log-probabilities.

- `sampler`: temperature / top-k / top-p sampling and the greedy argmax (`Sampler`,
  `SamplingTensors`).
- `state`: per-request device rows for penalties, logit_bias and min_tokens
  (`SamplingState`).
- `plan`: what a step needs beyond plain sampling (`SamplingPlan`), staged into and
  published from its own `SamplingBuffers`.
- `logprobs`: sampled and prompt log-probabilities (`StepLogprobs`).
- `logits_processors`: the torch reference of the options the kernels apply.
- `structured_output`: grammars and their token bitmasks.
"""
