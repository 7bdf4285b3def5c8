"""Completions -> one padded learner batch, aligned with `Decoder.token_logprobs` (column t = token t+1)."""
from __future__ import annotations

import dataclasses

import torch

from nemo_rz.generation.sampling import Completion


@dataclasses.dataclass
class Packed:
    input_ids: torch.Tensor  # [B, T] prompt + completion, zero-padded
    lengths: torch.Tensor  # [B]
    rollout_logprobs: torch.Tensor  # [B, T-1] float32, 0 outside the completion
    mask: torch.Tensor  # [B, T-1] float32, 1 on generated tokens
    rollout_routing: torch.Tensor | None = None  # [B, T-1, R] int16 (Completion.routing), -1 outside; None if any lacks it


def pack(completions: list[Completion]) -> Packed:
    if not completions:
        raise ValueError("pack: no completions to pack")
    seqs = [c.prompt_token_ids + c.token_ids for c in completions]
    b, length = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(b, length, dtype=torch.long)
    lp = torch.zeros(b, length - 1, dtype=torch.float32)
    mask = torch.zeros(b, length - 1, dtype=torch.float32)
    for i, (c, s) in enumerate(zip(completions, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        span = slice(len(c.prompt_token_ids) - 1, len(s) - 1)
        lp[i, span] = c.logprobs
        mask[i, span] = 1.0
    routing = None
    if all(c.routing is not None and len(c.routing) == len(c.token_ids) for c in completions):
        routing = torch.full((b, length - 1, completions[0].routing.shape[1]), -1, dtype=torch.int16)
        for i, (c, s) in enumerate(zip(completions, seqs)):
            routing[i, len(c.prompt_token_ids) - 1 : len(s) - 1] = c.routing
    return Packed(ids, torch.tensor([len(s) for s in seqs]), lp, mask, routing)
