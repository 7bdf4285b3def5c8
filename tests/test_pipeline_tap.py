"""The tap channel (nemo_rz.parallel.pipeline.TapChannel) in one process: a Decoder's forward tapped through it
gives, per micro-batch, the features draft.aux_features records (the points in their order).
Across ranks and stages the channel carries the Megatron learner's draft features:
tests/test_megatron_pipeline.py (the draft's weights after a PP=2 step equal the built-in learner's).
Negative control: reading a micro-batch under the other's index gives the other's features.
"""
from __future__ import annotations

import torch

from nemo_rz.models import Decoder, DecoderConfig
from nemo_rz.models.draft import aux_features
from nemo_rz.parallel.pipeline import TapChannel

AUX = (0, 2, 3)


def test_the_channel_delivers_each_micro_batch_as_aux_features_records_it():
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(num_layers=4))
    ids = torch.randint(0, model.config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(1))
    tap = TapChannel(AUX, lambda _mb, _n: 0, consumer=0, rank=0)  # one process: every point is computed here
    running = [0]
    want = []
    with torch.no_grad(), tap.tapping({n: model.model.layers[i] for n, i in enumerate(AUX)}, lambda: running[0]):
        for mb, chunk in enumerate(ids.chunk(2)):
            running[0] = mb
            with aux_features(model, AUX) as found:
                model.token_logprobs(chunk)
            want.append(found[0])
    h = model.config.hidden_size
    like = torch.empty_like(want[0][:, :h])
    assert torch.equal(tap.take(1, 0, like), want[1][:, :h])  # one point alone
    assert torch.equal(torch.cat([tap.take(0, n, like) for n in range(len(AUX))], -1), want[0])
    assert torch.equal(torch.cat([tap.take(1, n, like) for n in (1, 2)], -1), want[1][:, h:])
    assert not tap._kept  # every point taken once
    # negative control: the other micro-batch's features are not these
    assert not torch.equal(want[0], want[1])
