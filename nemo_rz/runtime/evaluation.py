"""Held-out evaluation: greedy pass@1 of the learner's current weights, and its history over a run."""
from __future__ import annotations

import torch

from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.models import Decoder
from nemo_rz.tasks import Task, evaluate_pass_at_1


class HeldOutEval:
    """Greedy pass@1 on the first `n` held-out problems; `history` holds (version, pass@1) of every call."""

    def __init__(self, model: Decoder, task: Task, n: int, max_new_tokens: int, max_model_len: int):
        self.model, self.task = model, task
        self.n = min(n, len(task.heldout))
        self.params = SamplingParams(max_new_tokens, temperature=0.0, stop_token_ids=task.tokenizer.eos_ids)
        self.max_model_len = max_model_len
        self.history: list[tuple[int, float]] = []

    @torch.no_grad()
    def __call__(self, version: int) -> float:
        self.model.eval()
        engine = RolloutEngine(self.model, max_batch_size=min(256, self.n), max_model_len=self.max_model_len)

        def generate(prompts):
            return [o.token_ids for o in engine.generate(prompts, self.params)]

        score = evaluate_pass_at_1(generate, self.task, "heldout", limit=self.n, batch_size=self.n)["pass_at_1"]
        self.history.append((version, score))
        return score

    def state_dict(self) -> dict:
        return {"evals": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = [tuple(e) for e in state["evals"]]
