"""MoE ops, gated activations and attention sinks: each consistent op against a float64 reference and bitwise
independent of the batch (size 1..64, order, composition, expert loads); the fast form, or the property broken
on purpose where the library is invariant on its own, is each check's negative control."""
import pytest
import torch

from nemo_rz import ops

E, K_IN, N_OUT = 8, 64, 96


def gen(seed):
    return torch.Generator().manual_seed(seed)


def batches(n, seed=0):
    """Row index lists: prefixes of many sizes (1..64), shuffles and random subsets of 0..n-1."""
    g = gen(seed)
    for m in (1, 2, 3, 4, 5, 8, 13, 17, 31, 32, 33, 47, 64):
        if m <= n:
            yield torch.arange(m)
    for m in (1, 7, 40, n):
        yield torch.randperm(n, generator=g)[:m]


def invariant(fn, rows, seed=0) -> bool:
    """fn(*(r[idx] for r in rows)) == fn(*rows)[idx] bit for bit for every batch idx (rows: per-row inputs)."""
    full = fn(*rows)
    return all(torch.equal(fn(*(r[idx] for r in rows)), full[idx]) for idx in batches(rows[0].shape[0], seed))


def prefixes_invariant(fn, rows) -> bool:
    """fn on the first m rows == the first m rows of fn on all, for every m: where a row falls in a SIMD loop
    (the scalar tail) shows at some m, whichever subsets `batches` picks."""
    full = fn(*rows)
    return all(torch.equal(fn(*(r[:m].clone() for r in rows)), full[:m]) for m in range(1, rows[0].shape[0]))


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(autouse=True)
def _consistent():
    with ops.use_kernels("consistent"):
        yield


# ------------------------------------------------------------------------------------------------ softmax
def test_softmax_matches_float64_and_is_row_invariant():
    x = torch.randn(64, 60, generator=gen(0)) * 3
    assert rel_err(ops.softmax(x), torch.softmax(x.double(), -1)) < 1e-6
    assert ops.softmax(x).dtype == torch.float32 and ops.softmax(x.bfloat16()).dtype == torch.float32
    assert invariant(ops.softmax, (x,))

    # Control: torch.softmax is row-invariant here on its own, so break the property on purpose: a row sum
    # through a library matrix-vector product, whose blocking follows the row count.
    def gemv_softmax(t):
        e = torch.exp(t - t.amax(-1, keepdim=True))
        return e / torch.mm(e, torch.ones(t.shape[1], 1))

    assert not invariant(gemv_softmax, (x,))


def test_softmax_gradient_is_the_library_softmax_gradient():
    x = torch.randn(20, 8, generator=gen(1), requires_grad=True)
    g = torch.randn(20, 8, generator=gen(2))
    (ops.softmax(x) * g).sum().backward()
    expect, = torch.autograd.grad((torch.softmax(x, -1) * g).sum(), x)
    assert torch.allclose(x.grad, expect, atol=1e-6)


# ---------------------------------------------------------------------------------------------- route_topk
def test_route_topk_orders_by_value_and_lower_index_wins_ties():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, -1.0, 5.0, 5.0], [-0.0, 0.0, -1.0, 4.0]])
    values, experts = ops.route_topk(scores, 2)
    assert experts.tolist() == [[1, 2], [0, 1], [2, 3], [3, 0]]
    assert values.tolist() == [[3.0, 3.0], [2.0, 2.0], [5.0, 5.0], [4.0, 0.0]]
    assert values.dtype == torch.float32 and experts.dtype == torch.int64


def test_route_topk_tie_rule_on_many_ties_and_fast_control():
    scores = torch.randint(0, 3, (300, 64), generator=gen(3)).float()  # every row full of exact ties
    expect = [sorted(range(64), key=lambda e, r=r: (-r[e], e))[:8] for r in scores.tolist()]
    values, experts = ops.route_topk(scores, 8)
    assert experts.tolist() == expect
    assert torch.equal(values, scores.gather(1, experts))
    assert invariant(lambda s: ops.route_topk(s, 8)[1], (scores,))
    with ops.use_kernels("fast"):  # torch.topk leaves ties unspecified: here it picks higher indices for some rows
        assert ops.route_topk(scores, 8)[1].tolist() != expect


def test_route_topk_rejects_non_finite_scores_and_bad_k():
    with pytest.raises(ValueError, match="NaN or inf"):
        ops.route_topk(torch.tensor([[0.0, float("nan")]]), 1)
    with pytest.raises(ValueError, match="1 <= k <= E"):
        ops.route_topk(torch.zeros(2, 4), 5)


# ------------------------------------------------------------------------------------------- expert_linear
def expert_weights(seed, dtype=torch.float32):
    g = gen(seed)
    w = torch.randn(E, K_IN, N_OUT, generator=g) / K_IN ** 0.5
    return w.to(dtype), torch.randn(E, N_OUT, generator=g).to(dtype)


def expert_reference(x, experts, w, b):
    return torch.einsum("mk,mkn->mn", x.double(), w.double()[experts]) + b.double()[experts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_linear_matches_float64_and_is_batch_invariant(dtype):
    w, b = expert_weights(4, dtype)
    x = torch.randn(64, K_IN, generator=gen(5)).to(dtype)
    experts = torch.randint(0, E, (64,), generator=gen(6))
    out = ops.expert_linear(x, experts, w, b)
    assert out.dtype == dtype
    assert rel_err(out, expert_reference(x, experts, w, b)) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert invariant(lambda xs, es: ops.expert_linear(xs, es, w, b), (x, experts))
    no_bias = ops.expert_linear(x, experts, w)
    assert rel_err(no_bias, expert_reference(x, experts, w, torch.zeros_like(b))) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_expert_linear_row_ignores_its_experts_load_and_fast_control():
    """A row's bits are the same whether its expert gets 1 row or all 64 (the loads vary with the batch)."""
    w, b = expert_weights(7)
    x = torch.randn(64, K_IN, generator=gen(8))
    spread = torch.arange(64) % E
    crowded = torch.full((64,), 3)
    crowded[::9] = torch.arange(8)[: len(crowded[::9])]

    def alone_vs_batch():
        bad = 0
        for experts in (spread, crowded):
            batch = ops.expert_linear(x, experts, w, b)
            alone = torch.cat([ops.expert_linear(x[m : m + 1], experts[m : m + 1], w, b) for m in range(64)])
            bad += int((alone != batch).any(-1).sum())
        return bad

    assert alone_vs_batch() == 0
    with ops.use_kernels("fast"):  # one library product per expert on exactly its rows: blocking follows the load
        assert alone_vs_batch() > 0
        assert not invariant(lambda xs, es: ops.expert_linear(xs, es, w, b), (x, spread))


def test_expert_linear_gradients():
    w, b = expert_weights(9)
    x = torch.randn(30, K_IN, generator=gen(10))
    experts = torch.randint(0, E, (30,), generator=gen(11))
    grad = torch.randn(30, N_OUT, generator=gen(12))
    grads = []
    for name in ("consistent", "fast"):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        with ops.use_kernels(name):
            (ops.expert_linear(leaves[0], experts, leaves[1], leaves[2]) * grad).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, expect in zip(*grads):
        assert torch.allclose(got, expect, atol=1e-5)
    assert float(grads[0][1][experts.unique()].abs().sum()) > 0
    small = (torch.randn(6, 5, dtype=torch.float64, generator=gen(13)), torch.randn(E, 5, 3, dtype=torch.float64, generator=gen(14)),
             torch.randn(E, 3, dtype=torch.float64, generator=gen(15)))
    small = tuple(t.requires_grad_() for t in small)
    assert torch.autograd.gradcheck(lambda a, ww, bb: ops.expert_linear(a, experts[:6], ww, bb), small)


def test_expert_linear_bad_input_is_one_clear_error():
    w, b = expert_weights(15)
    x = torch.randn(4, K_IN)
    with pytest.raises(ValueError, match="expert indices must lie in 0..7"):
        ops.expert_linear(x, torch.tensor([0, 1, 8, 2]), w, b)
    with pytest.raises(ValueError, match="weight_t \\[E, in, out\\]"):
        ops.expert_linear(x, torch.zeros(4, dtype=torch.long), w[:, :10], b)
    with pytest.raises(ValueError, match="integer \\[M=4\\]"):
        ops.expert_linear(x, torch.zeros(3, dtype=torch.long), w, b)


# --------------------------------------------------------------------------------------------- moe_combine
def combine_inputs(seed, n=64, k=4, h=48):
    g = gen(seed)
    y = torch.randn(n, k, h, generator=g)
    weights = torch.rand(n, k, generator=g)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    return y, weights, experts


def test_moe_combine_matches_float64_is_invariant_and_adds_in_expert_order():
    y, w, e = combine_inputs(16)
    combine = lambda yy, ww, ee: ops.moe_combine(yy.reshape(-1, yy.shape[-1]), ww, ee)  # noqa: E731
    ref = (y.double() * w.double().unsqueeze(-1)).sum(1)
    assert rel_err(combine(y, w, e), ref) < 1e-6
    assert invariant(combine, (y, w, e))
    # The slots of a token come in value order, which a tie or a rounding can change: the sum must not care.
    perm = torch.tensor([2, 0, 3, 1])
    shuffled = lambda: combine(y[:, perm], w[:, perm], e[:, perm])  # noqa: E731
    assert torch.equal(shuffled(), combine(y, w, e))
    with ops.use_kernels("fast"):  # a library sum in slot order
        assert not torch.equal(shuffled(), combine(y, w, e))
    bf = combine(y.bfloat16(), w, e)
    assert bf.dtype == torch.bfloat16 and rel_err(bf, ref) < 1e-2


def test_moe_combine_gradients_and_shape_error():
    y, w, e = combine_inputs(17, n=5, k=2, h=3)
    y, w = y.double().requires_grad_(), w.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda yy, ww: ops.moe_combine(yy.reshape(-1, 3), ww, e), (y, w))
    with pytest.raises(ValueError, match="y must be \\[N \\* k, H\\]"):
        ops.moe_combine(torch.zeros(9, 3), torch.zeros(5, 2), e)


def test_moe_layer_token_is_the_same_bits_in_any_batch_and_fast_control():
    """The ops composed as a MoE layer (softmax router, top-2, gate/up, SwiGLU, down, combine): a token's output
    is the same bits alone, in a batch of 64 and in shuffled sub-batches whose expert loads all differ."""
    g = gen(31)
    hidden, router = torch.randn(64, K_IN, generator=g), torch.randn(E, K_IN, generator=g) / K_IN ** 0.5
    gate_up, down = torch.randn(E, K_IN, 2 * N_OUT, generator=g) / 8, torch.randn(E, N_OUT, K_IN, generator=g) / 10

    def layer(x):
        weights, experts = ops.route_topk(ops.softmax(ops.linear(x, router)), 2)
        rows, flat = x.repeat_interleave(2, dim=0), experts.reshape(-1)
        h = ops.expert_linear(rows, flat, gate_up)
        y = ops.expert_linear(ops.silu_and_mul(h[:, :N_OUT], h[:, N_OUT:]), flat, down)
        return ops.moe_combine(y, weights, experts)

    assert invariant(layer, (hidden,))
    assert torch.equal(torch.cat([layer(hidden[i : i + 1]) for i in range(64)]), layer(hidden))
    with ops.use_kernels("fast"):
        assert not invariant(layer, (hidden,))


# --------------------------------------------------------------------------------------------- activations
LIMIT, ALPHA = 7.0, 1.702


def gelu_ref(g, u):
    g = g.double()
    return 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3))) * u.double()


def swiglu_ref(g, u):
    g, u = g.double().clamp(max=LIMIT), u.double().clamp(-LIMIT, LIMIT)
    return (u + 1) * g * torch.sigmoid(ALPHA * g)


ACTIVATIONS = {
    "gelu_tanh_and_mul": (ops.gelu_tanh_and_mul, gelu_ref),
    "clamped_swiglu": (lambda g, u: ops.clamped_swiglu(g, u, LIMIT, ALPHA), swiglu_ref),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_matches_float64_is_invariant_and_fast_control(name):
    fn, ref = ACTIVATIONS[name]
    g, u = (torch.randn(64, 100, generator=gen(s)) * 5 for s in (18, 19))  # beyond the clamp limit too
    assert rel_err(fn(g, u), ref(g, u)) < 1e-6
    assert invariant(fn, (g, u)) and prefixes_invariant(fn, (g, u))
    with ops.use_kernels("fast"):  # library element-wise kernels: bits depend on where a row falls in the SIMD loop
        assert rel_err(fn(g, u), ref(g, u)) < 1e-6
        assert not prefixes_invariant(fn, (g, u))
    # Interleaved halves of a fused projection (gpt-oss's gate_up) and bfloat16.
    fused = torch.stack([g, u], -1).reshape(64, 200)
    assert torch.equal(fn(fused[:, ::2], fused[:, 1::2]), fn(g, u))
    assert rel_err(fn(g.bfloat16(), u.bfloat16()), ref(g.bfloat16(), u.bfloat16())) < 1e-2


def test_activation_gradients():
    g, u = (torch.randn(6, 5, dtype=torch.float64, generator=gen(s), requires_grad=True) for s in (20, 21))
    for fn, _ in ACTIVATIONS.values():
        assert torch.autograd.gradcheck(lambda a, b: fn(a * 5, b * 5), (g, u))


# ---------------------------------------------------------------------------------------- attention sinks
HEADS, KV_HEADS, DIM, LENGTH = 4, 2, 16, 70


def attention_inputs(seed):
    g = gen(seed)
    k = torch.randn(3, KV_HEADS, 96, DIM, generator=g)
    v = torch.randn(3, KV_HEADS, 96, DIM, generator=g)
    q = torch.randn(3 * LENGTH, HEADS, DIM, generator=g)
    sinks = torch.tensor([-1.0, 0.5, 3.0, 30.0])  # the last one dominates every row of its head
    seq = torch.arange(3).repeat_interleave(LENGTH)
    pos = torch.arange(LENGTH).repeat(3)
    return q, k, v, sinks, seq, pos


def sink_reference(q, k, v, sinks, seq, pos, window=None):
    """Softmax over [scores, sink], the sink's column dropped: one query at a time, in float64."""
    out = []
    for i in range(q.shape[0]):
        keys = k[seq[i]].repeat_interleave(HEADS // KV_HEADS, 0).double()[:, : pos[i] + 1]
        vals = v[seq[i]].repeat_interleave(HEADS // KV_HEADS, 0).double()[:, : pos[i] + 1]
        s = torch.einsum("hd,hld->hl", q[i].double(), keys) * DIM ** -0.5
        if window is not None:
            s[:, : max(0, pos[i] + 1 - window)] = float("-inf")
        p = torch.softmax(torch.cat([s, sinks.double()[:, None]], 1), -1)[:, :-1]
        out.append(torch.einsum("hl,hld->hd", p, vals))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 9])
def test_attention_sinks_match_reference_and_decode_equals_prefill(window):
    q, k, v, sinks, seq, pos = attention_inputs(22)
    scale = DIM ** -0.5
    ref = sink_reference(q, k, v, sinks, seq, pos, window)
    prefill = ops.attention(q, k, v, seq, pos, scale, window, sinks=sinks)
    assert (prefill.double() - ref).abs().max() < 1e-5
    assert not torch.allclose(prefill, ops.attention(q, k, v, seq, pos, scale, window), atol=1e-3)
    assert torch.equal(ops.attention(q, k, v, seq, pos, scale, window, sinks=sinks.bfloat16()),
                       ops.attention(q, k, v, seq, pos, scale, window, sinks=sinks.bfloat16().float()))
    for i in (0, 31, 32, 33, 69, LENGTH + 5, 3 * LENGTH - 1):  # one query alone, as in decode
        alone = ops.attention(q[i : i + 1], k, v, seq[i : i + 1], pos[i : i + 1], scale, window, sinks=sinks)
        assert torch.equal(alone[0], prefill[i])
    for idx in batches(3 * LENGTH, seed=23):
        assert torch.equal(ops.attention(q[idx], k, v, seq[idx], pos[idx], scale, window, sinks=sinks), prefill[idx])
    with ops.use_kernels("fast"):
        fast = ops.attention(q, k, v, seq, pos, scale, window, sinks=sinks)
        assert (fast.double() - ref).abs().max() < 1e-5
        decode = torch.cat([ops.attention(q[i : i + 1], k, v, seq[i : i + 1], pos[i : i + 1], scale, window, sinks=sinks)
                            for i in range(LENGTH)])
        assert not torch.equal(decode, fast[:LENGTH])


@pytest.mark.parametrize("name", ["consistent", "fast"])
def test_attention_sink_gradients_match_reference(name):
    q, k, v, sinks, seq, pos = attention_inputs(24)
    q, seq, pos = q[:LENGTH:3], seq[:LENGTH:3], pos[:LENGTH:3]
    grad = torch.randn(q.shape, generator=gen(25))
    sinks = sinks.clone().requires_grad_()
    qd, sd = q.double().requires_grad_(), sinks.detach().double().requires_grad_()
    qf = q.clone().requires_grad_()
    with ops.use_kernels(name):
        (ops.attention(qf, k, v, seq, pos, DIM ** -0.5, 9, sinks=sinks) * grad).sum().backward()
    (sink_reference(qd, k, v, sd, seq, pos, 9) * grad.double()).sum().backward()
    assert (sinks.grad.double() - sd.grad).abs().max() < 1e-5 and float(sinks.grad.abs().sum()) > 0
    assert (qf.grad.double() - qd.grad).abs().max() < 1e-5


def test_one_plan_serves_layers_with_different_windows():
    q, k, v, sinks, seq, pos = attention_inputs(26)
    scale = DIM ** -0.5
    expect = {w: ops.attention(q, k, v, seq, pos, scale, w) for w in (None, 9)}
    assert not torch.equal(expect[None], expect[9])
    shared = ops.AttentionPlan(seq, pos, HEADS, KV_HEADS)
    per_window = {w: ops.AttentionPlan(seq, pos, HEADS, KV_HEADS, w) for w in (None, 9)}
    for name in ("consistent", "fast"):
        with ops.use_kernels(name):
            expect = {w: ops.attention(q, k, v, seq, pos, scale, w) for w in (None, 9)}
            for _layer in range(2):  # alternating sliding and full layers, as gpt-oss
                for w in (9, None):
                    assert torch.equal(ops.attention(q, k, v, seq, pos, scale, w, plan=shared), expect[w])
                    assert torch.equal(ops.attention(q, k, v, seq, pos, scale, w, plan=per_window[w]), expect[w])


def test_attention_sinks_paged_cache_equals_contiguous():
    q, k, v, sinks, seq, pos = attention_inputs(29)
    block = 16  # [num_blocks, Hkv, block, D], blocks shuffled
    n_blocks = 3 * 96 // block
    perm = torch.randperm(n_blocks, generator=gen(30))
    k_paged, v_paged = (c.reshape(3, KV_HEADS, -1, block, DIM).transpose(1, 2).reshape(n_blocks, KV_HEADS, block, DIM)[perm]
                        for c in (k, v))
    table = torch.empty(n_blocks, dtype=torch.long)
    table[perm] = torch.arange(n_blocks)
    for window in (None, 9):
        assert torch.equal(ops.attention(q, k_paged, v_paged, seq, pos, DIM ** -0.5, window, table.view(3, -1), sinks=sinks),
                           ops.attention(q, k, v, seq, pos, DIM ** -0.5, window, sinks=sinks))


def test_attention_sinks_shape_error():
    q, k, v, sinks, seq, pos = attention_inputs(27)
    with pytest.raises(ValueError, match="one logit per query head"):
        ops.attention(q, k, v, seq, pos, 0.25, sinks=sinks[:2])


def test_attention_reference_without_sinks_is_the_plain_softmax():
    """The reference's sink column at -inf weighs nothing: it reduces to plain causal attention."""
    q, k, v, _, seq, pos = attention_inputs(28)
    q, seq, pos = q[:LENGTH:7], seq[:LENGTH:7], pos[:LENGTH:7]
    plain = ops.attention(q, k, v, seq, pos, DIM ** -0.5)
    ref = sink_reference(q, k, v, torch.full((HEADS,), float("-inf")), seq, pos)
    assert (plain.double() - ref).abs().max() < 1e-5
