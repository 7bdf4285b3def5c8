import pytest
import torch

from nemo_rz import ops
from nemo_rz.models import Decoder, DecoderConfig


def tiny_model(seed: int = 0, **overrides) -> Decoder:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=48, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    cfg.update(overrides)
    model = Decoder(DecoderConfig(**cfg))
    # Larger-than-init weights give peaky, varied distributions, so differences are not hidden by tiny logits.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model.eval()


def learner_logprobs(model: Decoder, completions, temperature: float = 1.0) -> list[torch.Tensor]:
    """The learner's view: completions padded into one [B, T] batch, logprobs of the generated tokens."""
    seqs = [c.prompt_token_ids + c.token_ids for c in completions]
    length = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in seqs])
    with torch.no_grad():
        lp = model.token_logprobs(ids, lengths, temperature)
    return [lp[i, len(c.prompt_token_ids) - 1 : len(s) - 1] for i, (c, s) in enumerate(zip(completions, seqs))]


def count_diff(model, completions, temperature: float = 1.0) -> tuple[int, int]:
    """(tokens whose rollout and learner logprobs differ bitwise, tokens compared)."""
    diff = total = 0
    for c, lp in zip(completions, learner_logprobs(model, completions, temperature)):
        diff += int((lp != c.logprobs).sum())
        total += lp.numel()
    return diff, total


@pytest.fixture(autouse=True)
def _consistent_mode():
    with ops.mode("consistent"):
        yield


@pytest.fixture(scope="session")
def model():
    return tiny_model()
