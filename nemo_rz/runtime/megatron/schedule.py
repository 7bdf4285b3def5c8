"""Pipeline parallelism for the Megatron learner through Megatron's own schedule
(`megatron.core.pipeline_parallel.get_forward_backward_func`: non-interleaved 1F1B, P2P over gloo).

Each pipeline stage holds a GPTModel of its layers (model.py: pre_process on the first stage, post_process on
the last). The learner's loss is runtime.Learner's, over the whole batch's logprobs, which 1F1B cannot wait for
(it runs a micro-batch's backward as soon as the last stage has its forward). So a step is two runs of the
schedule over the same micro-batches (data_parallel.py's shares):

1. `logprobs`: forward only (no graph kept); the last stage's per-micro-batch logprobs are the batch's, sent to
   every stage, and every rank runs the loss on them (as under data parallelism).
2. `gradients`: the loss's gradient G with respect to the logprobs is known; the schedule runs forward and
   backward with the per-micro-batch loss sum(lp_i * G_i), whose gradient at lp_i is G_i exactly, so each
   parameter's gradient is the one autograd gives at PP=1 for that share. Each micro-batch's gradients are kept
   apart (a hook after each accumulation moves them out) and summed in data_parallel's fixed tree over the
   shares, as at PP=1: gradients equal PP=1's with the same grad_shares bit for bit.

The price is a second forward (as activation recomputation costs); what it buys is the loss code staying the
single-process one. Megatron's schedule allocates its buffers with `device="cuda"` and
`torch.cuda.current_device()`; `cpu_devices` maps those to the CPU while it runs (no CUDA here).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch.overrides import TorchFunctionMode


class _CPUFactories(TorchFunctionMode):
    """Tensors asked for on "cuda" (or a CUDA device index) are made on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and (isinstance(dev, int) or torch.device(dev).type == "cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_devices():
    """While Megatron's schedule runs on a machine without CUDA: its CUDA buffers on the CPU."""
    if torch.cuda.is_available():
        yield
        return
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        with _CPUFactories():
            yield
    finally:
        torch.cuda.current_device = real


class Schedule:
    """Megatron's pipeline schedule over `policy` (a MegatronPolicy, one stage of the model) and micro-batches
    of equal shape: a list of (input_ids [rows, T], lengths [rows])."""

    def __init__(self, policy):
        self.policy = policy
        self.run = get_forward_backward_func()
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.last = parallel_state.get_pipeline_model_parallel_last_rank()  # a global rank
        self.micro_batch = 0  # the micro-batch whose forward is running (the taps read it)

    def _schedule(self, chunks, temperature: float, loss=None):
        rows, length = chunks[0][0].shape
        policy = self.policy

        def step(data, _model):
            self.micro_batch, (ids, lengths) = next(data)
            out = policy._logits(ids)
            if not policy.last_stage:
                return out, None
            lp = policy.logprobs_of(out, ids, lengths, temperature)
            return lp, (None if loss is None else functools.partial(loss, self.micro_batch))

        with cpu_devices():
            return self.run(forward_step_func=step, data_iterator=iter(enumerate(chunks)), model=policy.gpt,
                            num_microbatches=len(chunks), seq_length=length, micro_batch_size=rows,
                            forward_only=loss is None)

    @torch.no_grad()
    def logprobs(self, chunks, temperature: float) -> torch.Tensor:
        """The micro-batches' logprobs [len(chunks) * rows, T-1] (float32), on every stage."""
        rows, length = chunks[0][0].shape
        out = self._schedule(chunks, temperature)
        whole = torch.cat(out) if self.policy.last_stage else torch.empty(len(chunks) * rows, length - 1)
        dist.broadcast(whole, src=self.last, group=self.group)
        return whole

    def gradients(self, chunks, grads, temperature: float, params) -> list[list[torch.Tensor | None]]:
        """Each micro-batch's gradient of sum(lp_i * grads[i]) for `params` (this stage's): a list per
        micro-batch, None for a parameter it did not reach. .grad is left as it was."""
        per = {p: [] for p in params}
        saved = {p: p.grad for p in params}

        def move(p):
            per[p].append(p.grad)
            p.grad = None

        for p in params:
            p.grad = None
        handles = [p.register_post_accumulate_grad_hook(move) for p in params]

        def loss(i, lp):
            return (lp * grads[i]).sum(), torch.ones((), dtype=torch.int), {}

        try:
            with torch.enable_grad():  # called from inside a backward, where autograd records nothing by default
                self._schedule(chunks, temperature, loss)
        finally:
            for h in handles:
                h.remove()
            for p in params:
                p.grad = saved[p]
        n = len(chunks)
        bad = [p for p in params if len(per[p]) not in (0, n)]
        if bad:
            raise RuntimeError(f"pipeline schedule: a parameter received {len(per[bad[0]])} gradients for {n} "
                               "micro-batches (the per-micro-batch split needs exactly one each)")
        return [[per[p][i] if per[p] else None for p in params] for i in range(n)]
