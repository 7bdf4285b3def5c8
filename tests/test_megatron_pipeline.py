"""Pipeline parallelism of the Megatron learner through Megatron's own schedule, and the co-trained draft on the
Megatron learner (its auxiliary-loss hook).

One launch of 2 ranks (tests/megatron_pipeline_ranks.py) computes: PP=2 logprobs (both kernel sets), PP=2
updates over 2 micro-batches (with a draft whose aux layers live on both stages) and over 1, a tied model at
PP=2, a mixture of experts (moe_tiny's shape) at PP=2, and TP=2 and DP=2 updates with the draft. Here, in one
process: PP=2 logprobs == PP=1 == the built-in Decoder bit for bit; PP=2 loss, logprobs, gradients (gathered to
whole weights) and weights after the step == PP=1's with the same grad_shares; the draft's weights after one
step == the built-in learner's at PP=1, PP=2, TP=2 and DP=2.
Negative controls: Megatron's own layers (fast) differ at PP=2; a schedule of 1 micro-batch instead of 2
changes the gradient bits (and equals PP=1 over 1 share); features routed to the wrong micro-batch change the
draft. The mixture of experts at PP=2: logprobs == the Decoder's, the routing record over stages (every rank's,
the whole model's layers in order) == the Decoder's, decompose's routing_diff_tokens 0 (1 with one expert
changed), the weights after two updates == PP=1's; negative controls: the fast kernels' logprobs differ, and
the record with its stages' layers swapped differs from the Decoder's.
The train CLI at megatron.pp=2 with a co-trained draft trains with zero kernel mismatch.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_moe_ranks import updates  # noqa: E402
from megatron_pipeline_ranks import draft, learner, model, moe_tiny  # noqa: E402
from megatron_ranks import rl_batch  # noqa: E402
from megatron_world import launched, world_of_one  # noqa: E402

from nemo_rz import ops  # noqa: E402
from nemo_rz.models.decoder import Packing  # noqa: E402
from nemo_rz.models.moe import recorded_routing  # noqa: E402
from nemo_rz.parallel.pipeline import TapChannel  # noqa: E402
from nemo_rz.runtime.learner import Learner  # noqa: E402
from nemo_rz.runtime.megatron.layout import Layout  # noqa: E402
from nemo_rz.runtime.megatron.model import MegatronPolicy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def one_process():
    with world_of_one():
        yield


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launched("megatron_pipeline_ranks.py", tmp_path_factory.mktemp("pp_ranks") / "out.pt")


def _pp1(shares: int, with_draft: bool = False, **kw) -> dict:
    """One update of the Megatron learner in this process (PP=1) over `shares` shares."""
    mirror = model(**kw)
    with ops.use_kernels("consistent"):
        lrn = learner(mirror, Layout(grad_shares=shares))
        if with_draft:
            lrn.add_aux_loss(draft(mirror))
        metrics, lp = lrn.rl_step(*rl_batch())
        out = dict(metrics=metrics, lp=lp, grads=lrn.gradients(), weights=lrn.state_dict_copy())
        if with_draft:
            out["draft"] = lrn.draft.shipped()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_pp2_logprobs_equal_pp1_and_the_decoder_bit_for_bit(ranks):
    m = model()
    b = rl_batch()[0]
    want = m.token_logprobs(b.input_ids, b.lengths)
    with ops.use_kernels("consistent"):
        pp1 = MegatronPolicy(m.config)
    pp1.load_state_dict(m.state_dict())
    assert torch.equal(pp1.token_logprobs(b.input_ids, b.lengths), want)
    assert torch.equal(ranks["pp2_consistent"], want)
    assert _same(ranks["pp2_consistent_weights"], m.state_dict())  # every stage's weights, whole, in HF names
    # negative control: Megatron's own layers round differently
    assert not torch.equal(ranks["pp2_fast"], want) and torch.allclose(ranks["pp2_fast"], want, atol=1e-4)


@pytest.mark.slow
def test_a_mixture_of_experts_over_stages_equals_the_decoder_bit_for_bit(ranks):
    m = moe_tiny().eval()
    b = rl_batch()[0]
    with torch.no_grad(), recorded_routing(m) as routing:
        want = m.token_logprobs(b.input_ids, b.lengths)
    length = b.input_ids.shape[1]
    # the Decoder's record (the rows of its Packing) in the padded [B * T] rows, every layer's k experts side by side
    packing = Packing.of(b.input_ids, b.lengths)
    experts = torch.cat([packing.unpack(log[0], -1) for log in routing.values()], -1)
    real = (torch.arange(length)[None, :] < b.lengths[:, None]).reshape(-1)
    assert torch.equal(ranks["pp2_moe_consistent"], want)
    assert _same(ranks["pp2_moe_consistent_weights"], m.state_dict())  # the experts of both stages, in HF names
    got = torch.cat([log[0] for log in ranks["pp2_moe_consistent_routing"].values()], -1)[: len(real)]
    assert got.shape == experts.shape and torch.equal(got[real], experts[real])
    k = m.config.num_experts_per_tok  # negative control: stage 1's layer recorded before stage 0's
    assert not torch.equal(torch.cat([got[:, k:], got[:, :k]], -1)[real], experts[real])
    # negative control: Megatron's stock MoE layer and attention round differently (a model they can run)
    with torch.no_grad():
        plain = moe_tiny(attention=False).eval().token_logprobs(b.input_ids, b.lengths)
    assert not torch.equal(ranks["pp2_moe_fast"], plain) and torch.allclose(ranks["pp2_moe_fast"], plain, atol=1e-4)
    pp2 = ranks["pp2_moe_updates"]
    assert pp2["routing_diff"] == [0, 1]
    with ops.use_kernels("consistent"):
        pp1 = updates(moe_tiny(), Layout(grad_shares=2))
    assert pp1["routing_diff"] == [0, 1]
    assert _same(pp2["weights"], pp1["weights"])  # two updates: every stage's experts moved as at PP=1


@pytest.mark.slow
def test_pp2_update_equals_pp1_over_the_same_micro_batches(ranks):
    pp2, pp1 = ranks["pp2_shares2"], _pp1(2)
    assert torch.equal(pp2["lp"], pp1["lp"])
    for k in ("loss", "k1", "k3", "grad_norm"):
        assert pp2["metrics"][k] == pp1["metrics"][k], k
    assert _same(pp2["grads"], pp1["grads"])
    assert _same(pp2["weights"], pp1["weights"]) and _same(pp2["mirror"], pp2["weights"])
    # negative control: one micro-batch (the whole batch in one backward) sums the rows in another order
    one = ranks["pp2_shares1"]
    assert not _same(one["grads"], pp2["grads"])
    assert all(torch.allclose(one["grads"][k], v, atol=1e-6) for k, v in pp2["grads"].items())
    assert _same(one["grads"], _pp1(1)["grads"])


@pytest.mark.slow
def test_tied_embeddings_across_stages_equal_pp1(ranks):
    pp2, pp1 = ranks["pp2_tied"], _pp1(2, tie_word_embeddings=True)
    assert "lm_head.weight" not in pp2["grads"]
    assert _same(pp2["grads"], pp1["grads"]) and _same(pp2["weights"], pp1["weights"])


def _builtin_draft() -> dict:
    mirror = model()
    with ops.use_kernels("consistent"):
        lrn = Learner(mirror, 1e-3, 1.0, 1.0, "reinforce_zero", "unclipped", {})
        lrn.add_aux_loss(draft(mirror))
        metrics, _ = lrn.rl_step(*rl_batch())
    return dict(draft=lrn.draft.shipped(), loss=metrics["draft_loss"])


@pytest.mark.slow
def test_the_draft_trains_on_the_megatron_learner_as_on_the_builtin_one(ranks, monkeypatch):
    want = _builtin_draft()["draft"]
    assert _same(_pp1(2, with_draft=True)["draft"], want)
    assert _same(ranks["pp2_shares2"]["draft"], want)  # features of layers 2, 3 and the final norm crossed stages
    assert _same(ranks["tp2_draft"]["draft"], want)
    assert _same(ranks["dp2_draft"]["draft"], want)  # the second share's features from the other replica
    # negative control: each micro-batch's features delivered as the other's
    real = TapChannel.take
    monkeypatch.setattr(TapChannel, "take", lambda self, mb, n, like: real(self, 1 - mb, n, like))
    assert not _same(_pp1(2, with_draft=True)["draft"], want)


@pytest.mark.slow
def test_train_cli_pp2_with_a_cotrained_draft_has_zero_kernel_mismatch(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "nemo_rz.train", "task.name=add1", "warmup.steps=40", "warmup.lr=0.003",
           "algo.prompts_per_update=4", "algo.group_size=4", "algo.updates=3", "eval.n=8", "eval.every=3", "model.hidden_size=32",
           "model.intermediate_size=64", "progress=false", "metrics.tensorboard=false", "metrics.decomposition_every=1",
           "runtime.learner=megatron", "megatron.pp=2", "draft.mode=cotrain", f"run_dir={run}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["kernel_diff_tokens"] == 0 for r in rows)  # the rollouts' weights moved
    assert any(r["grad_norm"] > 0 for r in rows) and all("draft_loss" in r for r in rows)

