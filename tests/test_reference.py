"""The synchronous reference step (runtime/reference.py) is the oracle of the asynchronous trainer: from the same
weights, prompts and seeds, the trainer's first update (max_lag 0, rollouts in a worker process) lands on the
same weights bit for bit. Negative control: the reference with standard kernels on the rollout side differs."""
import json
import random

import torch

from nemo_rz import config, ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.models import Decoder
from nemo_rz.runtime.reference import reinforce_zero_step
from nemo_rz.runtime.trainer import Trainer

TINY = [
    "task.name=add1", "warmup.steps=40", "warmup.lr=0.003", "algo.prompts_per_update=4", "algo.group_size=4",
    "eval.n=16", "eval.every=0", "model.hidden_size=32", "model.intermediate_size=64", "progress=false",
    "metrics.tensorboard=false", "metrics.decomposition_every=0", "checkpoint.every=0", "algo.max_lag=0", "algo.updates=1",
]


def _reference(trainer: Trainer, start: dict, kernels: str) -> tuple[Decoder, dict]:
    """The reference step from the trainer's starting weights on the trainer's first batch, with `kernels`."""
    a = trainer.cfg.algo
    model = Decoder(trainer.model.config)
    model.load_state_dict(start)
    engine = RolloutEngine(Decoder(trainer.model.config).eval(), max_batch_size=a.prompts_per_update * a.group_size,
                           max_model_len=trainer.max_model_len)
    engine.update_weights(start, 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=a.lr)
    problems = trainer.task.sample(a.prompts_per_update, random.Random(trainer.cfg.seed * 1_000_003))  # batch 0's draw
    job = trainer.job(0)
    assert [trainer.task.encode_prompt(p.prompt) for p in problems for _ in range(a.group_size)] == job.prompts
    params = SamplingParams(a.max_new_tokens, a.temperature, job.seed, job.stop_token_ids)
    with ops.use_kernels(kernels):
        metrics = reinforce_zero_step(model, optimizer, engine, trainer.task, problems, a.group_size, params,
                                      grad_clip=a.grad_clip, correction=a.correction, **dict(a.correction_params))
    return model, metrics


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], v) for k, v in b.items())


def test_first_async_update_equals_the_reference_step(tmp_path):
    cfg = config.load(None, TINY + [f"run_dir={tmp_path}"])
    trainer = Trainer(cfg, tmp_path, log=lambda *_: None)
    start = {k: v.clone() for k, v in trainer.history[0].policy.items()}
    trainer.run()
    after = trainer.model.state_dict()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])

    reference, metrics = _reference(trainer, start, "consistent")
    assert metrics["grad_norm"] > 0 and metrics["is_dev"] == 0.0  # a real step, on-policy: rho == 1 exactly
    assert row["loss"] == metrics["loss"] and row["grad_norm"] == metrics["grad_norm"]
    assert _equal(after, reference.state_dict()) and not _equal(after, start)

    fast, fast_metrics = _reference(trainer, start, "fast")  # negative control: the library kernels' step differs
    assert fast_metrics["is_dev"] > 0 and not _equal(after, fast.state_dict())
