"""routing_diff_tokens: the built-in engine records each sampled token's experts, the learner recomputes them
under the rollout's weights, and the decomposition counts the tokens whose experts differ.

0 in consistent mode (the learner recomputes the rollout's routing exactly, no replay); with fast rollout
kernels and near-tied routers (each token's choice hangs on the last bits) some tokens flip: the negative
control. The count survives the trip through the worker queue's encoding.
"""

import pytest
import torch
from conftest import tiny_model

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.metrics import routing_diff_tokens
from nemo_rz.runtime.jobs import decode_completions, encode_completions
from nemo_rz.runtime.learner import Learner
from nemo_rz.runtime.weights import WeightsBundle

MOE = dict(num_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=[0, 2])


def _near_tied(model):
    """Every router row within a relative 1e-6 of the first."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.copy_(gate.weight[0] * (1 + 1e-6 * torch.randn(gate.weight.shape, generator=g)))
    return model


def _rollout(model, kernels: str):
    prompts = [torch.randint(0, 48, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 17, 30) * 4]
    with ops.use_kernels(kernels):
        return RolloutEngine(model, max_batch_size=16, prefill_chunk=7).generate(prompts, SamplingParams(max_new_tokens=8, seed=1))


def _decompose(model, completions):
    learner = Learner(model, lr=1e-3, grad_clip=1.0, temperature=1.0, loss="reinforce_zero", correction="unclipped",
                      correction_params={})
    weights = WeightsBundle(0, {k: v.clone() for k, v in model.state_dict().items()})
    return learner.decompose(pack(decode_completions(encode_completions(completions))), weights)


def test_completions_carry_the_experts_of_every_moe_layer():
    outs = _rollout(tiny_model(seed=1, **MOE), "consistent")
    for c in outs:
        assert c.routing.dtype == torch.int16 and c.routing.shape == (len(c.token_ids), 2 * 2)
        assert int(c.routing.min()) >= 0 and int(c.routing.max()) < 8
    assert all(c.routing is None for c in _rollout(tiny_model(seed=1), "consistent"))  # dense: nothing recorded


def test_consistent_rollout_routes_every_token_as_the_learner():
    model = _near_tied(tiny_model(seed=2, **MOE))
    d = _decompose(model, _rollout(model, "consistent"))
    assert d["kernel_diff_tokens"] == 0 and d["routing_diff_tokens"] == 0


def test_fast_rollout_kernels_flip_some_routes():
    model = _near_tied(tiny_model(seed=2, **MOE))
    d = _decompose(model, _rollout(model, "fast"))
    assert d["routing_diff_tokens"] > 0 and d["kernel_diff_tokens"] >= d["routing_diff_tokens"]


def test_dense_models_report_no_routing_metric():
    model = tiny_model(seed=3)
    assert "routing_diff_tokens" not in _decompose(model, _rollout(model, "consistent"))


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="differ in shape"):
        routing_diff_tokens(torch.zeros(2, 3, 4), torch.zeros(2, 3, 2), torch.ones(2, 3))
