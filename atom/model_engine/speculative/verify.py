"""Verification of drafted tokens on the device: greedy acceptance, rejection sampling.

One target forward computes the logits of every verify row: a sequence with d drafts has
d + 1 rows (the last real token's and each draft's); row j predicts the token that draft
j + 1 guessed. `verify_rows` returns, per row, the token to emit if that row is the first
rejected one (or the last row) and whether the row's draft is accepted; the host keeps the
leading accepted drafts and the first emitted token after them (`accepted_tokens`).

Greedy rows (temperature 0): accepted iff the draft is the target's argmax; the emitted
token is the argmax, so the output equals plain greedy decoding token for token.

Random rows: both proposers propose one token deterministically (q = one-hot on the
draft), so the rejection rule of Leviathan et al. / Chen et al. becomes: accept draft x
with probability p(x); on rejection emit a sample of p with x removed (renormalized,
i.e. max(p - q, 0)); with no draft (last row) emit a sample of p. The emitted token is
then distributed exactly as p.
"""

from __future__ import annotations

import torch

from atom.model_engine.sampling.sampler import SamplingTensors, target_probs


def verify_rows(
    logits: torch.Tensor, params: SamplingTensors, drafts: torch.Tensor
) -> torch.Tensor:
    """logits [R, V], drafts [R] int64 (-1: no draft) -> [2, R] int64: (token, accepted)."""
    greedy = logits.argmax(dim=-1)
    if params.all_greedy:
        return torch.stack((greedy, (greedy == drafts).long()))
    probs = target_probs(logits, params)
    has_draft = drafts >= 0
    index = drafts.clamp(min=0).unsqueeze(1)
    p_draft = probs.gather(1, index).squeeze(1)
    uniform = torch.rand_like(p_draft)
    noise = torch.empty_like(probs).exponential_()
    if params.generators is not None:
        for row, generator in enumerate(params.generators):
            if generator is not None:
                uniform[row] = torch.rand((), generator=generator, device=probs.device)
                noise[row].exponential_(generator=generator)
    accepted = has_draft & (uniform < p_draft)
    residual = probs.scatter(1, index, torch.where(has_draft, 0.0, p_draft).unsqueeze(1))
    tokens = (residual / noise).argmax(dim=-1)
    temps = params.temperatures
    if temps is not None:  # greedy rows among random ones
        random_row = temps > 0
        tokens = torch.where(random_row, tokens, greedy)
        accepted = torch.where(random_row, accepted, greedy == drafts)
    return torch.stack((tokens, accepted.long()))


def accepted_tokens(
    drafts: list[list[int]], tokens: list[int], accepted: list[int]
) -> list[list[int]]:
    """Per sampling sequence (rows in order, len(drafts[i]) + 1 each): the accepted drafts,
    then the first emitted token after them."""
    out, row = [], 0
    for draft in drafts:
        n = 0
        while n < len(draft) and accepted[row + n]:
            n += 1
        out.append(draft[:n] + [tokens[row + n]])
        row += len(draft) + 1
    if row != len(tokens):
        raise ValueError(f"{len(tokens)} verified rows for {row} drafted ones")
    return out


def fill_device_drafts(input_ids, row_drafts, device_drafts, num_seqs: int) -> None:
    """A verify step whose drafts the proposer left on the device (every sequence: its
    last token, then d drafts): the drafts into the input ids (tokens 1..d of each
    sequence) and into the rows they are checked at (rows 0..d-1; row d checks none)."""
    drafts = device_drafts.view(num_seqs, -1)
    per_seq = drafts.shape[1] + 1
    input_ids[: num_seqs * per_seq].view(num_seqs, per_seq)[:, 1:] = drafts
    row_drafts.view(num_seqs, per_seq)[:, :-1] = drafts
