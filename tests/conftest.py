import pytest
import torch

from nemo_rz import ops
from nemo_rz.generation.packing import pack
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


def count_diff(model, completions, temperature: float = 1.0) -> tuple[int, int]:
    """(generated tokens whose rollout and learner logprobs differ bitwise, tokens compared), the learner
    seeing all completions padded into one [B, T] batch as in training."""
    batch = pack(completions)
    with torch.no_grad():
        lp = model.token_logprobs(batch.input_ids, batch.lengths, temperature)
    valid = batch.mask.bool()
    return int((lp[valid] != batch.rollout_logprobs[valid]).sum()), int(valid.sum())


@pytest.fixture(autouse=True)
def _consistent_mode():
    with ops.mode("consistent"):
        yield


@pytest.fixture(scope="session")
def model():
    return tiny_model()
