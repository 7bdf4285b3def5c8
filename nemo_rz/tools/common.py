"""Shared pieces of the command-line tools: loading a model and making test prompts."""
from __future__ import annotations

import sys

import torch

from nemo_rz.models import Decoder, DecoderConfig


def load_model(path: str | None, seed: int = 0) -> Decoder:
    """A Hugging Face checkpoint directory or .gguf file (nemo_rz.models.hf.load_hf), or (path None) a tiny random
    model with peaky distributions. The benchmarks and tools load real models through this."""
    if path:
        from nemo_rz.models.hf import load_hf

        return load_hf(path).eval()
    torch.manual_seed(seed)
    model = Decoder(DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model.eval()


def random_prompts(n: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in lengths]


def fail(message: str) -> None:
    """Bad input: one clear line on stderr, exit code 2, no traceback (docs/contracts.md, 7)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
