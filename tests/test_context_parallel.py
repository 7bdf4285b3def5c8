"""Context-parallel ring attention (nemo_rz.parallel.context): bit-equal to single-process attention.

On one process the forward equals ops.attention (consistent) bit for bit, for packed sequences of different
lengths with GQA, and so does branch attention against ops.attention over [main keys 0..p, branch keys at p].
Over 2 and 4 gloo processes every rank's outputs and gradients equal the one-process run's bit for bit.
Negative controls: ops.attention in fast mode, and the ring's partials merged in arrival order instead of
block order.

A whole Decoder under context parallelism (cp_token_logprobs, a packed row of sequences of different lengths):
its token logprobs equal model.token_logprobs on one process bit for bit, for 2 and 4 ranks, and so do the
gradients reaching every layer's input (per token); the parameter gradients, added over ranks by
reduce_gradients in a fixed tree, are the same bits on every rank and in every run, and equal one process's
within float32 rounding (each rank's matmuls sum over its own tokens only). Negative controls: the model with
fast kernels, the ring's partials in arrival order, and the ranks' gradients added in another order.

A draft's training-time test under context parallelism (cp_draft_loss): on one process it equals
DraftHead.training_loss within float32 rounding (negative control: step s > 1 without its branch); over 2 and 4
ranks every root's states and the loss are one process's bits and the draft's gradients are deterministic and
within float32 rounding (negative control: the ring's partials in arrival order).
"""
from __future__ import annotations

import functools
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_model

from nemo_rz import ops
from nemo_rz.models.draft import DraftHead, aux_features
from nemo_rz.parallel import context
from nemo_rz.parallel.context import ZigzagShard, branch_attention, cp_draft_loss, cp_token_logprobs, reduce_gradients, ring_attention
from nemo_rz.parallel.tensor import gather_parts

LENGTHS = (70, 150, 37, 200, 9)  # packed in one row; blocks of 32 keys: 3, 5, 2, 7, 1
HEADS, KV_HEADS, DIM, STEPS = 4, 2, 16, 2
SCALE = DIM ** -0.5


def _cu(lengths=LENGTHS):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _inputs(lengths=LENGTHS, heads=HEADS, kv_heads=KV_HEADS, steps=STEPS):
    """q, k, v [N, H | Hkv, D] and the branch steps' q, k, v [J, N, H | Hkv, D] of a packed row."""
    g = torch.Generator().manual_seed(0)
    n = sum(lengths)
    def r(*shape):
        return torch.randn(*shape, generator=g)
    return (r(n, heads, DIM), r(n, kv_heads, DIM), r(n, kv_heads, DIM),
            r(steps, n, heads, DIM), r(steps, n, kv_heads, DIM), r(steps, n, kv_heads, DIM))


def _seq_pos(lengths):
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return seq, torch.cat([torch.arange(n) for n in lengths])


def _cache(rows: list[torch.Tensor]) -> torch.Tensor:
    """[S, Hkv, L, D] (L a multiple of 32, zero past each sequence) from per-sequence keys [len, Hkv, D]."""
    length = max(r.shape[0] for r in rows)
    length += -length % ops.KV_BLOCK
    return torch.stack([torch.nn.functional.pad(r, (0, 0, 0, 0, 0, length - r.shape[0])).transpose(0, 1) for r in rows])


def _reference(q, k, v, qb, kb, vb, lengths=LENGTHS):
    """ops.attention on one process: the packed row (one cache row per sequence), and every branch query as a
    query at position p + j of its own sequence [main keys 0..p, branch keys 1..J at p]."""
    cu, (seq, pos) = _cu(lengths), _seq_pos(lengths)
    steps, heads = qb.shape[0], q.shape[1]
    def split(x):
        return [x[a:b] for a, b in zip(cu, cu[1:])]
    main = ops.attention(q, _cache(split(k)), _cache(split(v)), seq, pos, SCALE)
    n = q.shape[0]
    def own(x, b):
        return [torch.cat([x[cu[s] : cu[s] + p + 1], b[:, t]]) for t, (s, p) in enumerate(zip(seq.tolist(), pos.tolist()))]
    step = torch.arange(1, steps + 1).repeat_interleave(n)
    branch = ops.attention(qb.reshape(-1, heads, DIM), _cache(own(k, kb)), _cache(own(v, vb)), torch.arange(n).repeat(steps),
                           pos.repeat(steps) + step, SCALE)
    return main, branch.view(steps, n, heads, DIM)


def _grads(fn, inputs, index=None):
    """Outputs and the gradients of a fixed random projection of them (the projection of the whole row; its
    local tokens `index` on a rank)."""
    xs = [x.clone().requires_grad_() for x in inputs]
    main, branch = fn(*xs)
    g = torch.Generator().manual_seed(1)
    w_main, w_branch = torch.randn(sum(LENGTHS), HEADS, DIM, generator=g), torch.randn(STEPS, sum(LENGTHS), HEADS, DIM, generator=g)
    if index is not None:
        w_main, w_branch = w_main[index], w_branch[:, index]
    ((main * w_main).sum() + (branch * w_branch).sum()).backward()
    return (main.detach(), branch.detach()), [x.grad for x in xs]


def _local(inputs, shard):
    """The shard's tokens of main inputs [N, ...] and branch inputs [J, N, ...]."""
    i = shard.index
    return [x[i] if n < 3 else x[:, i] for n, x in enumerate(inputs)]


def _attention_grads(inputs, shard):
    """ring_attention's output and the gradients of its sum (every token's weight is 1, on any rank)."""
    xs = [x.clone().requires_grad_() for x in inputs]
    out = ring_attention(*xs, shard, SCALE)
    out.sum().backward()
    return out.detach(), [x.grad for x in xs]


def test_one_process_equals_ops_attention():
    inputs = _inputs()
    shard = ZigzagShard(_cu(), 1, 0)
    ref_main, ref_branch = _reference(*inputs)
    main, branch = branch_attention(*inputs, shard, SCALE)
    assert torch.equal(main, ref_main) and torch.equal(branch, ref_branch)
    assert torch.equal(ring_attention(*inputs[:3], shard, SCALE), ref_main)
    # Negative control: the library's standard kernels (fast mode) give other bits.
    with ops.use_kernels("fast"):
        fast_main, fast_branch = _reference(*inputs)
    assert not torch.equal(fast_main, main) and not torch.equal(fast_branch, branch)
    # Gradients: exact for the forward's arithmetic; the library backward of ops.attention sums the same
    # terms in other orders, so they agree to float32 rounding (measured: within 3e-7 of the largest).
    _, ours = _grads(lambda *x: branch_attention(*x, shard, SCALE), inputs)
    _, lib = _grads(_reference, inputs)
    for a, b in zip(ours, lib):
        assert (a - b).abs().max() <= 2e-6 * b.abs().max()


@pytest.mark.parametrize("heads, kv_heads, steps", [(2, 2, 3), (6, 2, 1)])
def test_block_boundaries_and_head_groups(heads, kv_heads, steps):
    """Sequences of 1, 31, 32, 33 and 65 tokens (branch keys spilling into the next block), other GQA groups."""
    lengths = (1, 31, 32, 33, 65)
    inputs = _inputs(lengths, heads, kv_heads, steps)
    main, branch = branch_attention(*inputs, ZigzagShard(_cu(lengths), 1, 0), SCALE)
    ref_main, ref_branch = _reference(*inputs, lengths=lengths)
    assert torch.equal(main, ref_main) and torch.equal(branch, ref_branch)


def test_queries_of_the_last_steps_only():
    """q None and the last Jq branch steps' queries: their outputs are the bits of the call with every step's
    queries; gradients within float32 rounding (their sums run over fewer rows)."""
    q, k, v, qb, kb, vb = _inputs(steps=3)
    shard = ZigzagShard(_cu(), 1, 0)
    w = torch.randn(2, *q.shape, generator=torch.Generator().manual_seed(5))
    full = [x.clone().requires_grad_() for x in (q, k, v, qb, kb, vb)]
    main, branch = branch_attention(*full, shard, SCALE)
    (branch[1:] * w).sum().backward()
    last = [x.clone().requires_grad_() for x in (qb[1:], k, v, kb, vb)]
    none, out = branch_attention(None, last[1], last[2], last[0], *last[3:], shard, SCALE)
    (out * w).sum().backward()
    assert none is None and torch.equal(out, branch[1:].detach())
    assert _close(last[0].grad, full[3].grad[1:], 2e-6)
    for got, want in zip(last[1:], full[1:3] + full[4:]):
        assert _close(got.grad, want.grad, 2e-6)
    # Negative control: the same queries as steps 1..2 of a 2-step branch see one branch key fewer.
    assert not torch.equal(branch_attention(None, k, v, qb[1:], kb[:2], vb[:2], shard, SCALE)[1], out)
    with pytest.raises(ValueError, match="the last 1..J steps"):
        branch_attention(None, k, v, torch.cat([qb, qb[:1]]), kb, vb, shard, SCALE)


def test_zigzag_balances_causal_work():
    """Each rank holds chunks c and 2W-1-c of a sequence: causal work (keys seen) per rank within 5% of the mean,
    where a contiguous split is off by more than 50% (the negative control)."""
    n, world = 4096, 4
    work = [float((ZigzagShard([0, n], world, r).positions + 1).sum()) for r in range(world)]
    mean = sum(work) / world
    assert max(abs(w - mean) for w in work) < 0.05 * mean
    contiguous = [float(torch.arange(r * n // world, (r + 1) * n // world).add(1).sum()) for r in range(world)]
    assert max(abs(w - mean) for w in contiguous) > 0.5 * mean
    # Short sequences (one block each) are dealt round the ranks, not piled on one.
    short = [ZigzagShard([0, *range(20, 20 * 65, 20)], world, r).index.shape[0] for r in range(world)]
    assert short == [16 * 20] * world
    # Every token on exactly one rank, and key blocks never split.
    shards = [ZigzagShard(_cu(), world, r) for r in range(world)]
    assert torch.equal(torch.sort(torch.cat([s.index for s in shards])).values, torch.arange(sum(LENGTHS)))
    for s in shards:
        assert torch.equal(torch.unique(s.slot // ops.KV_BLOCK), torch.arange(s.num_blocks))


def test_bad_input_is_one_clear_error():
    inputs = _inputs()
    q, k, v = inputs[:3]
    with pytest.raises(ValueError, match="cu_seqlens"):
        ZigzagShard([0, 5, 5], 2, 0)
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        ZigzagShard(_cu(), 2, 2)
    shard = ZigzagShard(_cu(), 1, 0)
    with pytest.raises(ValueError, match="local token count"):
        ring_attention(q[:-1], k, v, shard, SCALE)
    with pytest.raises(ValueError, match="non-finite"):
        ring_attention(q.index_fill(0, torch.tensor([3]), float("nan")), k, v, shard, SCALE)
    two = ZigzagShard(_cu(), 2, 0)
    with pytest.raises(ValueError, match="init_process_group"):
        ring_attention(*_local(inputs, two)[:3], two, SCALE)


def run_ranks(fn, world: int) -> None:
    """fn(rank, world) in `world` spawned processes joined in a gloo group on 127.0.0.1, 1 torch thread each
    (a failed assertion in any of them fails the caller)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_in_group, args=(world, port, fn), nprocs=world, join=True)


def _in_group(rank: int, world: int, port: int, fn) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world)
    finally:
        dist.destroy_process_group()


def _arrival_order(n_rows, parts):
    """context._ordered_sum's partials added in the order they were computed (ring arrival), not by key."""
    values = torch.cat([v.reshape(-1, v.shape[-1]) for v, _, _ in parts])
    dest = torch.cat([d.reshape(-1) for _, d, _ in parts])
    return values.new_zeros(n_rows, values.shape[-1]).index_add_(0, dest, values)


def _worker(rank: int, world: int) -> None:
    inputs = _inputs()
    # The one-process run (already shown equal to ops.attention) is the reference for every rank.
    (ref_main, ref_branch), ref_grads = _grads(lambda *x: branch_attention(*x, ZigzagShard(_cu(), 1, 0), SCALE), inputs)
    shard = ZigzagShard(_cu(), world, rank)
    i = shard.index
    (main, branch), grads = _grads(lambda *x: branch_attention(*x, shard, SCALE), _local(inputs, shard), i)
    assert torch.equal(main, ref_main[i]) and torch.equal(branch, ref_branch[:, i])
    for got, ref in zip(grads, _local(ref_grads, shard)):
        assert torch.equal(got, ref)
    assert torch.equal(shard.gather(main), ref_main)
    assert torch.equal(ring_attention(*_local(inputs, shard)[:3], shard, SCALE), ref_main[i])

    # Two one-block sequences over `world` ranks: some ranks hold no tokens and still take part in the rings.
    cu, small = [0, 20, 45], [x[:45] for x in inputs[:3]]
    few = ZigzagShard(cu, world, rank)
    ref, ref_grads = _attention_grads(small, ZigzagShard(cu, 1, 0))
    got, got_grads = _attention_grads(_local(small, few), few)
    assert torch.equal(got, ref[few.index]) and all(torch.equal(a, b[few.index]) for a, b in zip(got_grads, ref_grads))

    # Negative control: the same partials merged in the order they arrived round the ring.
    context._ordered_sum, ordered = _arrival_order, context._ordered_sum
    try:
        bad = branch_attention(*_local(inputs, shard), shard, SCALE)[0]
    finally:
        context._ordered_sum = ordered
    differs = torch.tensor([float(not torch.equal(bad, ref_main[i]))])
    dist.all_reduce(differs)
    assert differs.item() > 0, "merging in ring-arrival order should change some bits"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes: the slow tier
def test_ring_over_gloo_equals_one_process(world):
    run_ranks(_worker, world)


# -- a whole Decoder under context parallelism ---------------------------------------------------------------


def _decoder():
    return tiny_model(vocab_size=64)  # hidden 64, 2 layers, 4/2 heads, head_dim 16


def _row(lengths=LENGTHS):
    return torch.randint(0, 64, (sum(lengths),), generator=torch.Generator().manual_seed(2))


def _dense_logprobs(model, ids, lengths=LENGTHS):
    """model.token_logprobs of the sequences padded into one [B, T] batch, laid out like the packed row (0 at
    each sequence's last token)."""
    cu = _cu(lengths)
    batch = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for s, (a, b) in enumerate(zip(cu, cu[1:])):
        batch[s, : b - a] = ids[a:b]
    lp = model.token_logprobs(batch, torch.tensor(lengths))
    out = torch.zeros(sum(lengths))
    for s, (a, b) in enumerate(zip(cu, cu[1:])):
        out[a : b - 1] = lp[s, : b - a - 1]
    return out


def _loss_weights(shard=None):
    w = torch.randn(sum(LENGTHS), generator=torch.Generator().manual_seed(3))
    return w if shard is None else w[shard.index]


def _decoder_grads(model, ids, group=None):
    """cp_token_logprobs of the row, and after backward of a fixed weighting of them: the gradient reaching each
    layer's input [n, hidden] (this rank's tokens) and the parameter gradients summed over ranks."""
    model.zero_grad(set_to_none=True)
    inputs = []

    def keep(_module, args):
        args[0].retain_grad()
        inputs.append(args[0])

    handles = [layer.register_forward_pre_hook(keep) for layer in model.model.layers]
    try:
        lp, shard = cp_token_logprobs(model, ids, _cu(), group)
    finally:
        for h in handles:
            h.remove()
    (lp * _loss_weights(shard)).sum().backward()
    partial = {n: p.grad.clone() for n, p in model.named_parameters()}
    reduce_gradients(model, group)
    return lp.detach(), shard, [x.grad for x in inputs], {n: p.grad for n, p in model.named_parameters()}, partial


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 5e-6) -> bool:
    return bool((a - b).abs().max() <= rel * b.abs().max())


def test_decoder_one_process_equals_token_logprobs():
    model, ids = _decoder(), _row()
    lp, shard, _, grads, _ = _decoder_grads(model, ids)
    ref = _dense_logprobs(model, ids)
    assert torch.equal(shard.index, torch.arange(sum(LENGTHS))) and torch.equal(lp, ref)
    # Negative control: the same model with the library's kernels gives other bits.
    with ops.use_kernels("fast"):
        assert not torch.equal(_dense_logprobs(model, ids), lp)
    # Gradients: the ring's attention backward sums the library backward's terms in other orders.
    model.zero_grad()
    (_dense_logprobs(model, ids) * _loss_weights()).sum().backward()
    for name, p in model.named_parameters():
        assert _close(grads[name], p.grad), name


def test_decoder_refuses_what_the_ring_does_not_compute():
    ids = _row()
    for overrides, what in ((dict(sliding_window=64), "sliding-window"), (dict(attention_sinks=True), "attention sinks"),
                            (dict(num_experts=4, num_experts_per_tok=2), "mixture-of-experts")):
        with pytest.raises(ValueError, match=f"dense full-attention decoders; this model has {what}"):
            cp_token_logprobs(tiny_model(vocab_size=64, **overrides), ids, _cu())
    model = _decoder()
    with pytest.raises(ValueError, match=r"one packed row of token ids \[cu_seqlens\[-1\]\]"):
        cp_token_logprobs(model, ids[:-1], _cu())
    with pytest.raises(ValueError, match="vocab_size"):
        cp_token_logprobs(model, ids + 64, _cu())


def _decoder_worker(rank: int, world: int, ref) -> None:
    model, ids = _decoder(), _row()
    lp, shard, layer_grads, grads, partial = _decoder_grads(model, ids)
    i = shard.index
    assert torch.equal(lp, ref["logprobs"][i])
    assert torch.equal(shard.gather(lp), ref["logprobs"])
    for got, want in zip(layer_grads, ref["layer_grads"]):
        assert torch.equal(got, want[i])
    for name, g in grads.items():
        assert _close(g, ref["grads"][name]), name
    # The reduced gradients: the same bits on every rank, and again in a second run.
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    assert all(torch.equal(part, flat) for part in gather_parts(flat))
    again = _decoder_grads(model, ids)[3]
    assert all(torch.equal(again[n], g) for n, g in grads.items())

    # Rows too short to reach every rank: some ranks hold no tokens and still take part in the rings.
    few, _ = cp_token_logprobs(model, ids[:45], [0, 20, 45])
    assert torch.equal(few, ref["few"][ZigzagShard([0, 20, 45], world, rank).index])

    # Negative controls. (1) The ring's partials merged in the order they arrived: other logprobs and other
    # gradients at the layers' inputs.
    context._ordered_sum, ordered = _arrival_order, context._ordered_sum
    try:
        bad, _, bad_layer_grads, _, _ = _decoder_grads(model, ids)
    finally:
        context._ordered_sum = ordered
    differs = torch.tensor([float(not torch.equal(bad, lp)),
                            float(any(not torch.equal(a, b) for a, b in zip(bad_layer_grads, layer_grads)))])
    dist.all_reduce(differs)
    assert differs.min().item() > 0, "merging in ring-arrival order should change some bits"
    # (2) The ranks' gradients added one after another as they might arrive (last rank first) instead of in
    # the fixed tree: other bits (with 2 ranks there is one addition, and a + b == b + a).
    if world > 2:
        parts = gather_parts(torch.cat([g.reshape(-1) for g in partial.values()]))
        folded = parts[-1]
        for part in reversed(parts[:-1]):
            folded = folded + part
        assert not torch.equal(folded, flat), "adding the ranks' gradients in another order should change some bits"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes: the slow tier
def test_decoder_over_gloo_equals_one_process(world):
    torch.set_num_threads(1)
    model, ids = _decoder(), _row()
    lp, _, layer_grads, grads, _ = _decoder_grads(model, ids)
    few, _ = cp_token_logprobs(model, ids[:45], [0, 20, 45])
    ref = dict(logprobs=lp, layer_grads=layer_grads, grads=grads, few=few.detach())
    run_ranks(functools.partial(_decoder_worker, ref=ref), world)


# -- a draft's training-time test under context parallelism ---------------------------------------------------

DRAFT_STEPS, DRAFT_TEMPERATURE = 3, 0.8


def _draft_setup():
    """The target, a 2-layer draft over 40 of its 64 tokens, the packed row, its mask [T] (mask[i]: the token
    after i is trained) and the target's features of the row (aux, final) from a one-process forward."""
    target = tiny_model(seed=2, num_layers=3, vocab_size=64)
    torch.manual_seed(0)
    draft = DraftHead(target.config, (0, 1, 2), num_layers=2, vocab_size=40)
    ids = _row()
    draft.choose_vocab(ids)
    mask = torch.rand(sum(LENGTHS), generator=torch.Generator().manual_seed(4)) < 0.8
    with aux_features(target, draft.aux_layers, final=True) as found, torch.no_grad():
        cp_token_logprobs(target, ids, _cu())
    return target, draft, ids, mask, found[0]


def _draft_grads(target, draft, ids, mask, aux, final, group=None, cu=None):
    """cp_draft_loss of the row (distilled with `final`, else hard labels), the draft's parameter gradients
    after backward and reduce_gradients, and every step's last-layer MLP output of this rank's roots [n, H]."""
    draft.zero_grad(set_to_none=True)
    states = []
    hook = draft.layers[-1].mlp.register_forward_hook(lambda _m, _a, out: states.append(out.detach()))
    try:
        part, loss, metrics = cp_draft_loss(draft, target, aux, final, ids, mask, cu or _cu(), DRAFT_STEPS,
                                            DRAFT_TEMPERATURE, group)
    finally:
        hook.remove()
    part.backward()
    reduce_gradients(draft, group)
    return loss.detach(), metrics, {n: p.grad for n, p in draft.named_parameters()}, states


def _padded(x: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Rows of the packed row [T, ...] as a zero-padded [B, max length (- 1 with width), ...] batch."""
    cu = _cu()
    out = x.new_zeros(len(LENGTHS), max(LENGTHS) if width is None else width, *x.shape[1:])
    for s, (a, b) in enumerate(zip(cu, cu[1:])):
        n = min(b - a, out.shape[1])
        out[s, :n] = x[a : a + n]
    return out


def _without_branch(q, keys, values, scale, shard, group):
    """A wrong attention for the negative control: every step causal over its own step's entries only."""
    return ring_attention(q, keys[-1], values[-1], shard, scale, group)


@pytest.mark.parametrize("distill", [True, False])
def test_draft_loss_one_process_equals_training_loss(distill, monkeypatch):
    """On one process cp_draft_loss computes DraftHead.training_loss of the sequences padded into a batch: the
    same layers and loss terms, attention by the consistent arithmetic instead of a dense softmax, so loss and
    gradients agree within float32 rounding (measured: losses within 2e-7, gradients 6e-7 of each largest)."""
    target, draft, ids, mask, (aux, final) = _draft_setup()
    loss, metrics, grads, _ = _draft_grads(target, draft, ids, mask, aux, final if distill else None)
    draft.zero_grad()
    lengths = torch.tensor(LENGTHS)
    dense_mask = _padded(mask, max(LENGTHS) - 1) & (torch.arange(max(LENGTHS) - 1) < lengths[:, None] - 1)
    def flat(x):
        return _padded(x).flatten(0, 1)
    ref, ref_metrics = draft.training_loss(target, flat(aux), _padded(ids), dense_mask, DRAFT_STEPS, DRAFT_TEMPERATURE,
                                           final=flat(final) if distill else None)
    ref.backward()
    assert metrics.keys() == ref_metrics.keys() and len(metrics) == DRAFT_STEPS
    # The acceptance estimates from the rollout's logprobs (the layout of mask): the batch's own numbers.
    rollout = -torch.rand(sum(LENGTHS), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        accept = cp_draft_loss(draft, target, aux, final if distill else None, ids, mask, _cu(), DRAFT_STEPS,
                               DRAFT_TEMPERATURE, rollout_logprobs=rollout)[2]
        want = draft.training_loss(target, flat(aux), _padded(ids), dense_mask, DRAFT_STEPS, DRAFT_TEMPERATURE,
                                   _padded(rollout, max(LENGTHS) - 1), flat(final) if distill else None)[1]
    assert accept.keys() == want.keys() and len(want) == 2 * DRAFT_STEPS
    assert all(abs(accept[k] - want[k]) <= 1e-6 * abs(want[k]) for k in want)
    assert abs(float(loss) - float(ref.detach())) <= 1e-6 * abs(float(ref.detach()))
    assert all(abs(metrics[k] - ref_metrics[k]) <= 1e-6 * abs(ref_metrics[k]) for k in metrics)
    for name, p in draft.named_parameters():
        assert _close(grads[name], p.grad), name
    # Negative control: without the branch (step s > 1 sees only its own step's entries) the later steps'
    # losses leave that tolerance.
    monkeypatch.setattr(context, "draft_attention", _without_branch)
    wrong = _draft_grads(target, draft, ids, mask, aux, final if distill else None)[1]
    assert wrong["draft_loss_1"] == metrics["draft_loss_1"]
    assert all(abs(wrong[k] - ref_metrics[k]) > 1e-4 * abs(ref_metrics[k]) for k in ("draft_loss_2", "draft_loss_3"))


def _dense_softmax(q, keys, values, scale, shard, group):
    """The negative control below: the draft's former plain-torch attention (one softmax over each root's step-1
    entries 0..t and its own entries of steps 2..s) for a shard of equal-length sequences on one rank."""
    n, heads, dim = q.shape
    length = shard.cu_seqlens[1]
    def split(t):
        return t.view(-1, length, t.shape[1], dim).transpose(1, 2).repeat_interleave(heads // t.shape[1], 1)
    qs = split(q)
    main = (qs @ split(keys[0]).transpose(-1, -2) * scale).masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(),
                                                                       float("-inf"))
    p = torch.softmax(torch.cat([main, *[(qs * split(k)).sum(-1, keepdim=True) * scale for k in keys[1:]]], -1), -1)
    out = p[..., :length] @ split(values[0])
    for j, v in enumerate(values[1:]):
        out = out + p[..., length + j : length + j + 1] * split(v)
    return out.transpose(1, 2).reshape(n, heads, dim)


def test_draft_dense_batch_is_the_packed_rows_bits(monkeypatch):
    """DraftHead.training_loss's [B, T] batch (DraftHead.branches) attends through the same core as cp_draft_loss
    (parallel.context on one rank), so every root's states at every step are the packed row's bits, whatever the
    padding. Negative control: the draft's former dense softmax in the batch agrees only within rounding."""
    target, draft, ids, mask, (aux, final) = _draft_setup()

    def states(fn):
        out = []
        hook = draft.layers[-1].register_forward_hook(lambda _m, _a, x: out.append(x.detach()))
        try:
            with torch.no_grad():
                fn()
        finally:
            hook.remove()
        return out

    packed = states(lambda: cp_draft_loss(draft, target, aux, final, ids, mask, _cu(), DRAFT_STEPS, DRAFT_TEMPERATURE))
    def batch():
        return list(draft.branches(target, _padded(aux).flatten(0, 1), _padded(ids), DRAFT_STEPS))
    rows = torch.cat([s * max(LENGTHS) + torch.arange(n) for s, n in enumerate(LENGTHS)])  # the row's tokens in the batch
    dense = states(batch)
    assert len(dense) == len(packed) == DRAFT_STEPS
    assert all(torch.equal(d[rows], p) for d, p in zip(dense, packed))
    monkeypatch.setattr(context, "draft_attention", _dense_softmax)
    softmax = states(batch)
    assert all(_close(d[rows], p) for d, p in zip(softmax, packed)) and not torch.equal(softmax[0][rows], packed[0])


def test_draft_loss_bad_input_is_one_clear_error():
    target, draft, ids, mask, (aux, final) = _draft_setup()
    with pytest.raises(ValueError, match=r"aux \(465, 192\): need this rank's 466 tokens"):
        cp_draft_loss(draft, target, aux[:-1], final, ids, mask, _cu(), DRAFT_STEPS)
    with pytest.raises(ValueError, match="finite"):
        cp_draft_loss(draft, target, aux, final.index_fill(0, torch.tensor([7]), float("nan")), ids, mask, _cu(), DRAFT_STEPS)
    with pytest.raises(ValueError, match=r"mask \(465,\)"):
        cp_draft_loss(draft, target, aux, final, ids, mask[:-1], _cu(), DRAFT_STEPS)
    with pytest.raises(ValueError, match=r"rollout_logprobs \(465,\): need the row's logprobs"):
        cp_draft_loss(draft, target, aux, final, ids, mask, _cu(), DRAFT_STEPS, rollout_logprobs=-torch.rand(465))
    assert cp_draft_loss(draft, target, aux, final, ids, torch.zeros_like(mask), _cu(), DRAFT_STEPS) == (None, None, {})


def _draft_worker(rank: int, world: int, ref) -> None:
    target, draft, ids, mask, _ = _draft_setup()
    # Each rank's target features from the target's own CP forward.
    with aux_features(target, draft.aux_layers, final=True) as found, torch.no_grad():
        _, shard = cp_token_logprobs(target, ids, _cu())
    (aux, final), i = found[0], shard.index
    assert torch.equal(aux, ref["aux"][i]) and torch.equal(final, ref["final"][i])
    loss, metrics, grads, states = _draft_grads(target, draft, ids, mask, aux, final)
    # Every root's states at every step are one process's bits, so its loss term is too, and so the loss (the
    # terms added in row order).
    assert all(torch.equal(got, want[i]) for got, want in zip(states, ref["states"], strict=True))
    assert torch.equal(loss, ref["loss"]) and metrics == ref["metrics"]
    for name, g in grads.items():
        assert _close(g, ref["grads"][name]), name
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    assert all(torch.equal(part, flat) for part in gather_parts(flat))
    again = _draft_grads(target, draft, ids, mask, aux, final)
    assert torch.equal(again[0], loss) and all(torch.equal(again[2][n], g) for n, g in grads.items())
    # A row too short to reach every rank: ranks without roots still take part in the rings.
    few = ZigzagShard([0, 20, 45], world, rank).index
    short = _draft_grads(target, draft, ids[:45], mask[:45], ref["aux"][few], ref["final"][few], cu=[0, 20, 45])
    assert torch.equal(short[0], ref["few"])
    # Negative control: the ring's partials merged in arrival order change some roots' states (on some rank)
    # and the gradients.
    context._ordered_sum, ordered = _arrival_order, context._ordered_sum
    try:
        _, _, bad_grads, bad_states = _draft_grads(target, draft, ids, mask, aux, final)
    finally:
        context._ordered_sum = ordered
    differs = torch.tensor([float(any(not torch.equal(a, b) for a, b in zip(bad_states, states)))])
    dist.all_reduce(differs)
    assert differs.item() > 0, "merging in ring-arrival order should change some roots' states"
    assert any(not torch.equal(bad_grads[n], g) for n, g in grads.items()), "... and the gradients"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes: the slow tier
def test_draft_loss_over_gloo_equals_one_process(world):
    """The distilled draft loss over 2 and 4 ranks: the same bits as one process (each root's term is computed
    from bit-equal attention and row-wise ops); the draft's gradients, added over ranks in a fixed tree, the
    same bits on every rank and in every run and within float32 rounding of one process's."""
    torch.set_num_threads(1)
    target, draft, ids, mask, (aux, final) = _draft_setup()
    loss, metrics, grads, states = _draft_grads(target, draft, ids, mask, aux, final)
    few = _draft_grads(target, draft, ids[:45], mask[:45], aux[:45], final[:45], cu=[0, 20, 45])[0]
    ref = dict(aux=aux, final=final, loss=loss, metrics=metrics, grads=grads, states=states, few=few)
    run_ranks(functools.partial(_draft_worker, ref=ref), world)
