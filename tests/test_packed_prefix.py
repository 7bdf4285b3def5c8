"""The learner runs a prefix that several sequences share once (models.decoder.Packing): a GRPO group's prompt,
a common start. The logprobs are the bits of every sequence run on its own, for dense, windowed and MoE models,
in training and in the rollout's comparison; the gradients are within rounding of the unshared ones and the same
run to run; the tokens the layers run drop to the distinct prefixes plus the completions."""
import pytest
import torch
from conftest import tiny_model

from nemo_rz.algorithms import aux_loss
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.models.decoder import BatchKV, Packing, Tokens, packed_rows

VARIANTS = {
    "dense": {},
    "window": dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
    "moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
}


def _groups(seed=0, groups=3, group_size=4, prompt=9, completion=7):
    """A padded batch of `groups` prompts x `group_size` random completions of varied length; two rows share more
    than the prompt, one row repeats another exactly, and one group's prompt is a prefix of another's."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 48, (prompt,), generator=g) for _ in range(groups)]
    prompts[2][: prompt - 3] = prompts[1][: prompt - 3]
    rows = [torch.cat([p, torch.randint(0, 48, (int(torch.randint(1, completion + 1, (1,), generator=g)),),
                                         generator=g)]) for p in prompts for _ in range(group_size)]
    rows[1] = torch.cat([rows[0][: prompt + 2], rows[1][prompt + 2:]]) if len(rows[1]) > prompt + 2 else rows[1]
    rows[3] = rows[2].clone()
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    mask = torch.zeros(len(rows), ids.shape[1] - 1)
    for i, n in enumerate(lengths.tolist()):
        mask[i, prompt - 1 : n - 1] = 1.0
    return ids, lengths, mask


def test_the_packing_runs_each_distinct_prefix_once_and_every_position_reads_its_tokens():
    ids, lengths, _ = _groups()
    p = Packing.of(ids, lengths)
    b, length = ids.shape
    valid = torch.arange(length)[None, :] < lengths[:, None]
    flat = ids.reshape(-1)[p.rows]
    assert torch.equal(flat[p.where[valid]], ids[valid])  # every valid position reads a row holding its token
    assert not (p.where[~valid] >= 0).any()
    # and the tokens before it: a row's (sequence, position) is one whose whole prefix equals the reader's
    seq, pos = p.rows // length, p.rows % length
    for i in range(b):
        for t in range(int(lengths[i])):
            r = int(p.where[i, t])
            assert int(pos[r]) == t and torch.equal(ids[seq[r], : t + 1], ids[i, : t + 1])
    distinct = {tuple(ids[i, : t + 1].tolist()) for i in range(b) for t in range(int(lengths[i]))}
    assert p.rows.numel() == len(distinct) < int(lengths.sum())
    unshared = Packing.of(torch.arange(b * length).view(b, length) % 1000, lengths)  # no two rows alike
    assert torch.equal(unshared.rows, packed_rows(lengths, length))
    x = torch.randn(p.rows.numel(), 3)
    assert torch.equal(p.unpack(x, -1.0).view(b, length, 3)[valid], x[p.where[valid]])


@pytest.mark.parametrize("variant", VARIANTS)
def test_shared_prefix_logprobs_are_each_sequence_alone_bit_for_bit(variant):
    model = tiny_model(seed=2, **VARIANTS[variant])
    ids, lengths, mask = _groups(seed=3)
    with torch.no_grad():
        shared = model.token_logprobs(ids, lengths, 0.8, mask=mask)
        padded = model.token_logprobs(ids, None, 0.8, mask=mask)  # every row of the [B, T] batch, nothing shared
        alone = [model.token_logprobs(ids[i : i + 1, :n], lengths[i : i + 1], 0.8, mask=mask[i : i + 1, : n - 1])[0]
                 for i, n in enumerate(lengths.tolist())]
    assert torch.equal(shared, padded)
    for i, n in enumerate(lengths.tolist()):
        assert torch.equal(shared[i, : n - 1], alone[i]), i


def test_negative_control_a_row_shared_with_other_earlier_tokens_differs():
    """Pointing one sequence's prompt positions at another prompt's rows (tokens that differ earlier) changes its
    logprobs: the equality above needs each shared row's whole prefix to match."""
    model = tiny_model(seed=2)
    ids, lengths, mask = _groups(seed=3)
    p = Packing.of(ids, lengths)
    wrong = p.where.clone()
    wrong[4, :5] = p.where[0, :5]  # group 1's first five positions read group 0's rows
    b, length = ids.shape
    with torch.no_grad():
        right = model.hidden(model.packed(ids, lengths, p))
        bad = model.hidden(Tokens(ids.reshape(-1)[p.rows], p.rows % length, p.rows // length,
                                  BatchKV(b, int(lengths.max()), wrong)))
    mine = p.where[4, 5 : int(lengths[4])]  # group 1's own later rows see the wrong keys
    assert not torch.equal(right[mine], bad[mine])


def test_shared_prefix_gradients_are_close_to_the_unshared_ones_and_the_same_run_to_run():
    model = tiny_model(seed=4, **VARIANTS["window"]).train()
    ids, lengths, mask = _groups(seed=5)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(6)) * mask

    def grads(lp):
        model.zero_grad(set_to_none=True)
        (lp * weights).sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    want = grads(model.token_logprobs(ids, None, mask=mask))
    got = grads(model.token_logprobs(ids, lengths, mask=mask))
    again = grads(model.token_logprobs(ids, lengths, mask=mask))
    for k in want:
        # summed in another order (a shared row's gradient gathers its readers'): rounding of the largest entries
        assert torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6 * float(want[k].abs().max())), k
        assert torch.equal(got[k], again[k]), k


def test_rollouts_of_a_group_match_the_shared_prefix_learner_and_tap_in_the_padded_layout():
    model = tiny_model(seed=6)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    params = SamplingParams(8, temperature=0.9, seed=2)
    batch = pack(RolloutEngine(model).generate([p for p in prompts for _ in range(4)], params))
    assert Packing.of(batch.input_ids, batch.lengths).rows.numel() <= int(batch.lengths.sum()) - 3 * 6 - 3 * 3
    taps = []
    handle = model.model.layers[0].register_forward_hook(lambda m, a, out: taps.append(out.detach()))
    with torch.no_grad():
        lp = model.token_logprobs(batch.input_ids, batch.lengths, 0.9, mask=batch.mask)
        model.hidden(model.tokens(batch.input_ids))  # the padded batch's layer-0 output: the hook's second tap
    handle.remove()
    valid = batch.mask.bool()
    assert torch.equal(lp[valid], batch.rollout_logprobs[valid])
    real = (torch.arange(batch.input_ids.shape[1])[None, :] < batch.lengths[:, None]).reshape(-1)
    assert torch.equal(aux_loss.padded(taps[0], batch)[real], taps[1][real])
    with pytest.raises(ValueError, match="tap the learner's forward of this batch"):
        aux_loss.padded(taps[0][:-1], batch)
