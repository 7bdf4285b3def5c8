"""Pipeline stages over gloo with a tap channel (nemo_rz.parallel.pipeline).

A 4-layer Decoder split into 2 stages (GPipe, 2 micro-batches) and a draft head on the last stage fed by the
outputs of layers 0 (on stage 0: through the channel), 2 and 3 (local): the policy loss and every gradient, the
draft loss and the draft's gradients equal the one-process run's bit for bit. The one-process run itself
matches the model's own forward (token logprobs) and draft.aux_features (the features). Negative control:
features delivered under the other micro-batch's tag change the draft loss.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_context_parallel import run_ranks

from nemo_rz import ops
from nemo_rz.models import Decoder, DecoderConfig
from nemo_rz.models.draft import DraftHead, aux_features
from nemo_rz.parallel.pipeline import Pipeline, TapChannel, embedded, stage_layers

AUX, STEPS, MICRO = (0, 2, 3), 2, 2


def _setup():
    torch.manual_seed(0)
    cfg = DecoderConfig(num_layers=4)
    model, draft = Decoder(cfg), DraftHead(cfg, aux_layers=AUX)
    ids = torch.randint(0, cfg.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1))
    return model, draft, ids


def _policy_loss(model, hidden, ids):
    b, length = ids.shape
    h = hidden.view(b, length, -1)[:, :-1].reshape(b * (length - 1), -1)
    return -ops.token_logprobs(model.logits(h), ids[:, 1:].reshape(-1)).mean()


def _draft_loss(model, draft):
    def loss(_mb, features, ids):
        return draft.training_loss(model, features, ids, torch.ones(ids.shape[0], ids.shape[1] - 1), STEPS)[0] / MICRO
    return loss


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _one_process():
    model, draft, ids = _setup()
    tap = TapChannel(AUX, 4, 1, consumer=0)
    out = Pipeline(model, tap=tap).step(ids, MICRO, _policy_loss, _draft_loss(model, draft))
    return out, _grads(model), _grads(draft)


def test_one_process_run_matches_the_model():
    model, draft, ids = _setup()
    x, t = embedded(model, ids)
    for i in range(4):
        x = model.model.layers[i](x, t)
    assert torch.equal(model.model.norm(x), model.hidden(t))
    # Micro-batched, layer-by-layer token logprobs equal the model's whole-batch ones (batch-invariant ops).
    whole = model.token_logprobs(ids)
    for chunk, rows in zip(ids.chunk(MICRO), whole.chunk(MICRO)):
        x, t = embedded(model, chunk)
        for i in [*stage_layers(4, 2, 0), *stage_layers(4, 2, 1)]:
            x = model.model.layers[i](x, t)
        b, length = chunk.shape
        h = model.model.norm(x).view(b, length, -1)[:, :-1].reshape(b * (length - 1), -1)
        assert torch.equal(ops.token_logprobs(model.logits(h), chunk[:, 1:].reshape(-1)).view(b, length - 1), rows)
    tap = TapChannel(AUX, 4, 1, consumer=0)
    with tap.tapping(model, 0, 0), aux_features(model, AUX) as found, torch.no_grad():
        model.hidden(embedded(model, ids[:2])[1])
    assert torch.equal(tap.features(0, torch.empty(48, 64)), found[0])


def test_bad_settings():
    with pytest.raises(ValueError, match="pipeline stages"):
        stage_layers(2, 3, 0)
    with pytest.raises(ValueError, match="outside 0..3"):
        TapChannel((1, 4), 4, 2, consumer=1)
    model, _, ids = _setup()
    with pytest.raises(ValueError, match="divide evenly"):
        Pipeline(model).step(ids, 3, _policy_loss)


def _worker(rank: int, world: int) -> None:
    ref, ref_model, ref_draft = _one_process()
    channel_group = dist.new_group(backend="gloo")  # the tap channel's own: never the schedule's
    model, draft, ids = _setup()
    tap = TapChannel(AUX, 4, world, consumer=world - 1, group=channel_group)
    out = Pipeline(model, dist.group.WORLD, tap).step(ids, MICRO, _policy_loss, _draft_loss(model, draft))
    mine = set(stage_layers(4, world, rank))
    grads = _grads(model)
    expected = {n for n in ref_model if (n.startswith("model.layers.") and int(n.split(".")[2]) in mine)
                or (rank == 0 and "embed_tokens" in n)
                or (rank == world - 1 and not n.startswith("model.layers.") and "embed_tokens" not in n)}
    assert set(grads) == expected
    for n, g in grads.items():
        assert torch.equal(g, ref_model[n]), n
    if rank == world - 1:
        assert out == ref
        got = _grads(draft)
        assert got.keys() == ref_draft.keys() and all(torch.equal(got[n], ref_draft[n]) for n in got)

    # Negative control: the consumer reads each micro-batch's remote features under the other's tag.
    model, draft, ids = _setup()
    tap = TapChannel(AUX, 4, world, consumer=world - 1, group=channel_group)
    if rank == world - 1:
        tap._tag = lambda mb, index: (MICRO - 1 - mb) * len(AUX) + index
    bad = Pipeline(model, dist.group.WORLD, tap).step(ids, MICRO, _policy_loss, _draft_loss(model, draft))
    if rank == world - 1:
        assert bad["loss"] == ref["loss"] and bad["draft_loss"] != ref["draft_loss"]
    # A step whose consumer trains no draft still drains the channel (the senders' step ends).
    model, _, ids = _setup()
    plain = Pipeline(model, dist.group.WORLD, TapChannel(AUX, 4, world, consumer=world - 1, group=channel_group))
    assert plain.step(ids, MICRO, _policy_loss)["loss"] == (ref["loss"] if rank == world - 1 else 0.0)


def test_two_stages_over_gloo_equal_one_process():
    run_ranks(_worker, 2)
