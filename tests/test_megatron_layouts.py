"""The Megatron learner's layout matrix: every layout of 4 ranks with each axis (tp, pp, cp, ep, dp) in {1, 2} that
the learner drives (tests/megatron_layout_ranks.py: one launch, Megatron's groups re-initialised per layout), on
gloo, against one process over the same gradient shares.

Per layout: the RL update's logprobs equal the built-in Decoder's bit for bit (consistent kernels); its
gradients, loss and weights are the same bits run to run; the loss equals one process's bit for bit, and the
gradients too along the axes whose reduction is one process's (dp, and pp's micro-batches: the fixed tree over
the shares), up to rounding along tp and cp: tp's column-parallel backward sums the ranks' partial input
gradients (another order than one product over all outputs: from the last layer's input down, the bits differ;
the output layer's own gradient stays bitwise), cp's ranks each sum a weight's gradient over their own tokens
before the fixed tree over the ranks adds them; and along ep for the experts' own weights alone: an expert's
backward products run over the tokens it got on its rank, and the library's bits depend on that row count (every
other gradient stays bitwise). Negative control per layout: Megatron's stock modules (fast
kernels) give other logprobs, or are refused in one line (cp: no ring without Transformer Engine; ep: the stock
MoE layer keeps its experts on one rank). Also: which
backend and device a rank's environment selects."""
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_layout_ranks import LAYOUTS, RUNS, WORLD, learner, model  # noqa: E402
from megatron_ranks import rl_batch  # noqa: E402
from megatron_world import launched, world_of_one  # noqa: E402

from nemo_rz.runtime.megatron import distributed  # noqa: E402
from nemo_rz.runtime.megatron.layout import Layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Parameters whose gradient stays bitwise one process's under tp: the output layer's (its input is the same bits
# on every rank, its output gradient the log-softmax of the gathered logits).
TP_BITWISE = ("lm_head.weight",)
EXPERTS = ".experts."  # in the Hugging Face name of every expert weight (stacked or per expert)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts") / "out.pt"
    return launched("megatron_layout_ranks.py", out, WORLD)


@pytest.fixture(scope="module")
def one_process():
    """One process's RL update for each model and number of gradient shares the layouts use."""
    with world_of_one():
        got = {}
        for family, shares in sorted({(family, layout.shares) for layout, family in LAYOUTS.values()}):
            lrn = learner(model(family), Layout(grad_shares=shares))
            metrics, lp = lrn.rl_step(*rl_batch())
            got[family, shares] = dict(metrics=metrics, lp=lp, grads=lrn.gradients(), weights=lrn.state_dict_copy())
        yield got


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_logprobs_and_gradients_against_one_process(matrix, one_process, name):
    layout, family = LAYOUTS[name]
    got, again, fast = (matrix[f"{name}/{run}"] for run in RUNS)
    if "refused" in got:  # a combination the learner does not drive: one line naming the axis, on every run
        assert "\n" not in got["refused"] and again == got, got
        pytest.skip(f"refused: {got['refused']}")
    ref = one_process[family, layout.shares]
    batch, _ = rl_batch()
    with torch.no_grad():
        decoder = model(family).token_logprobs(batch.input_ids, batch.lengths, mask=batch.mask)
    assert torch.equal(got["lp"], decoder) and torch.equal(got["lp"], ref["lp"])
    # run to run: the same bits
    assert torch.equal(again["lp"], got["lp"]) and _equal(again["grads"], got["grads"])
    assert _equal(again["weights"], got["weights"]) and again["metrics"] == got["metrics"]
    # against one process
    assert got["grads"].keys() == ref["grads"].keys()
    assert got["metrics"]["loss"] == ref["metrics"]["loss"]  # from the bit-equal logprobs, by the same code
    if layout.tp == 1 and layout.cp == 1 and layout.ep == 1:  # dp, pp: the fixed tree over the shares
        assert _equal(got["grads"], ref["grads"]) and _equal(got["weights"], ref["weights"])
        assert got["metrics"] == ref["metrics"]
    else:
        if layout.tp == 1 and layout.cp == 1:  # ep alone: only the experts' own gradients may differ
            assert all(torch.equal(g, ref["grads"][k]) for k, g in got["grads"].items() if EXPERTS not in k)
        else:
            if layout.cp == 1:
                assert all(torch.equal(got["grads"][k], ref["grads"][k]) for k in TP_BITWISE if k in ref["grads"])
            assert not _equal(got["grads"], ref["grads"])  # tp's partial input gradients, cp's token halves
        for k, want in ref["grads"].items():  # measured: at most ~1.2e-6 of the tensor's largest entry
            assert float((got["grads"][k] - want).abs().max()) <= 1e-5 * float(want.abs().max()), k
        assert got["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
    # negative control: Megatron's stock modules give other bits, or (cp: no ring attention without Transformer
    # Engine) are refused in one line
    if layout.cp > 1:
        assert fast == dict(refused=fast["refused"]) and f"megatron.cp = {layout.cp} with kernels=fast" in fast["refused"]
    elif layout.ep > 1:  # the stock MoE layer runs its experts on one rank here
        assert fast == dict(refused=fast["refused"]) and fast["refused"].startswith(f"megatron.ep = {layout.ep}: the fast")
        assert "\n" not in fast["refused"]
    else:
        assert not torch.equal(fast["lp"], decoder) and torch.allclose(fast["lp"], decoder, atol=1e-4)


def test_each_rank_environment_selects_its_backend_and_device():
    cpu = distributed.placement("cpu", env={"LOCAL_RANK": "1"}, cuda_devices=8)
    assert cpu == distributed.CPU and cpu.backend == "gloo" and cpu.device == torch.device("cpu")
    on = distributed.placement("cuda", env={"LOCAL_RANK": "1", "RANK": "5"}, cuda_devices=2)
    assert on.backend == "cpu:gloo,cuda:nccl" and on.device == torch.device("cuda", 1)
    assert distributed.placement("cuda", env={"RANK": "3"}, cuda_devices=4).device == torch.device("cuda", 3)
    assert distributed.placement("cuda", env={}, cuda_devices=1).device == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="local rank 2 needs cuda:2, but this process sees 2 CUDA device"):
        distributed.placement("cuda", env={"LOCAL_RANK": "2"}, cuda_devices=2)
    with pytest.raises(ValueError, match="sees no CUDA device"):
        distributed.placement("cuda", env={}, cuda_devices=0)
    if not torch.cuda.is_available():  # this machine: what torch reports is what is used
        with pytest.raises(ValueError, match="megatron.device = cuda: this process sees no CUDA device"):
            distributed.placement("cuda", env={"LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="megatron.device = 'tpu': expected one of cpu, cuda"):
        Layout(device="tpu")
