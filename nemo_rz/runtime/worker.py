"""The rollout role: an engine that generates a job's batch with the exact weight version it names."""
from __future__ import annotations

import time

import torch

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.models import Decoder, DecoderConfig
from nemo_rz.runtime.jobs import Job, encode_completions


class RolloutWorker:
    def __init__(self, model_config: dict, kernels: str, dtype: str, max_batch_size: int, max_model_len: int, threads: int):
        torch.set_num_threads(threads)
        ops.set_mode(kernels)
        cfg = DecoderConfig.from_dict({**model_config, "dtype": dtype})
        self.engine = RolloutEngine(Decoder(cfg).eval(), max_batch_size=max_batch_size, max_model_len=max_model_len)
        self.dtype = cfg.torch_dtype
        self.loaded: int | None = None  # the engine starts with random weights, not version 0

    def load(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        if self.loaded != version:
            self.engine.update_weights({k: v.to(self.dtype) for k, v in state_dict.items()}, version)
            self.loaded = version

    def run(self, job: Job) -> tuple[list[tuple], float]:
        """Generate the job's completions; returns them in wire form and the seconds it took."""
        if self.loaded != job.version:
            raise RuntimeError(f"worker holds weights v{self.engine.weight_version} but job {job.batch} needs v{job.version}")
        start = time.perf_counter()
        params = SamplingParams(job.max_new_tokens, job.temperature, job.seed, job.stop_token_ids)
        outs = self.engine.generate(job.prompts, params)
        return encode_completions(outs), time.perf_counter() - start
