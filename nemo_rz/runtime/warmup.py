"""Supervised warm-up: a few steps of teacher forcing on the task's answers, so RL starts from a non-zero reward."""
from __future__ import annotations

import random
import time

import torch

from nemo_rz.runtime.learner import Learner
from nemo_rz.tasks import Task


def warm_up(learner: Learner, task: Task, steps: int, batch_size: int, lr: float, seed: int, log=print) -> None:
    """`steps` supervised steps at `lr` on training problems drawn from `seed`; the loss covers the answer tokens
    only. Raises DivergenceError from the learner; RL then starts with a fresh optimizer (Learner.supervised)."""
    if steps <= 0:
        return
    rng = random.Random(seed)
    start = time.time()
    with learner.supervised(lr):
        for step in range(steps):
            seqs, prompt_lens = [], []
            for p in task.sample(batch_size, rng):
                prompt = task.encode_prompt(p.prompt)
                seqs.append(prompt + task.encode_answer(p.answer))
                prompt_lens.append(len(prompt))
            length = max(map(len, seqs))
            ids = torch.zeros(len(seqs), length, dtype=torch.long)
            target = torch.zeros(len(seqs), length - 1)
            for i, (s, n) in enumerate(zip(seqs, prompt_lens)):
                ids[i, : len(s)] = torch.tensor(s)
                target[i, n - 1 : len(s) - 1] = 1.0
            loss = learner.sft_step(ids, torch.tensor([len(s) for s in seqs]), target, f"warm-up step {step + 1}")
    log(f"warm-up: {steps} supervised steps in {time.time() - start:.1f}s, final loss {loss:.3f}")
