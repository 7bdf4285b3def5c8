"""The rollout role: an engine that generates a job's batch with the exact weight version it names."""
from __future__ import annotations

import time

import torch

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.speculative import Speculator
from nemo_rz.models import Decoder, DecoderConfig
from nemo_rz.models.draft import from_spec as draft_from_spec
from nemo_rz.models.lora import LoraSpec, apply_lora, is_adapter
from nemo_rz.protocols import RolloutEngineProtocol
from nemo_rz.quant.apply import apply_precision
from nemo_rz.runtime.jobs import Job, encode_completions
from nemo_rz.runtime.weights import WeightsBundle


class RolloutWorker:
    """generation_backend: "builtin" (nemo_rz's RolloutEngine) or "vllm" (VLLMRolloutEngine: vLLM running the same
    Decoder and ops, built on the first weights it is given; `temperature` is its engine-wide temperature).
    precision: the learner's `precision.*` (nemo_rz.quant), applied to the engine's model so that both sides
    quantize the same master weights alike. lora: the learner's `lora.*` (rank, alpha, rslora, modules): after the
    first version, whose base it keeps, the worker loads each version's adapters alone. draft: {aux_layers,
    num_layers, k} for speculative rollouts (built-in engine; the draft's weights arrive with each weight version),
    or None."""

    def __init__(self, model_config: dict, kernels: str, dtype: str, max_batch_size: int, max_model_len: int, threads: int,
                 generation_backend: str = "builtin", temperature: float = 1.0, precision: dict | None = None,
                 draft: dict | None = None, lora: dict | None = None):
        torch.set_num_threads(threads)
        ops.set_kernels(kernels)
        cfg = DecoderConfig.from_dict({**model_config, "dtype": dtype})
        self.dtype = cfg.torch_dtype
        self.loaded: int | None = None  # the engine starts with random weights, not version 0
        self.lora = LoraSpec.of(lora)  # adapters (models/lora.py) on the engine's model, as on the learner's
        self.engine: RolloutEngineProtocol | None
        if draft is not None and generation_backend != "builtin":
            raise ValueError("draft.mode: speculative rollouts run in the built-in engine; use generation.backend=builtin")
        if generation_backend == "builtin":
            model = apply_lora(apply_precision(Decoder(cfg).eval(), precision), lora)
            speculator = None
            if draft is not None:
                speculator = Speculator(draft_from_spec(cfg, draft), draft["k"])
            self.engine = RolloutEngine(model, max_batch_size=max_batch_size, max_model_len=max_model_len,
                                        speculator=speculator)
        elif generation_backend == "vllm":
            self.engine = None  # built on the first load(), from the weights it must start with
            self._vllm_args = dict(config=cfg, max_batch_size=max_batch_size, max_model_len=max_model_len,
                                   temperature=temperature, kernels=kernels, multiprocess=False, precision=precision,
                                   lora=lora)
        else:
            raise ValueError(f"generation.backend = {generation_backend!r}: use builtin or vllm")

    def load(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Version `version`'s weights, in the flat form a WeightsBundle travels in."""
        if self.loaded == version:
            return
        if self.loaded is not None and self.lora.enabled:  # the base is loaded and never changes: the adapters alone
            state_dict = {k: v for k, v in state_dict.items() if is_adapter(k)}
        bundle = WeightsBundle.from_flat(state_dict, version).to(self.dtype)
        if self.engine is None:
            from nemo_rz.generation.vllm import VLLMRolloutEngine

            self.engine = VLLMRolloutEngine(bundle.policy, weight_version=version, **self._vllm_args)
        else:
            self.engine.update_weights(bundle.policy, version, bundle.parts)
        self.loaded = version

    def run(self, job: Job) -> tuple[list[tuple], float, dict]:
        """Generate the job's completions; returns them in wire form, the seconds it took and the engine's
        speculative counts for the job (proposed, accepted draft tokens and verify passes; empty without a draft)."""
        if self.loaded != job.version:
            raise RuntimeError(f"worker holds weights v{self.loaded} but job {job.batch} needs v{job.version}")
        start = time.perf_counter()
        params = SamplingParams(job.max_new_tokens, job.temperature, job.seed, job.stop_token_ids)
        stats = getattr(self.engine, "stats", {})  # a Counter on the built-in engine
        before = {k: v for k, v in stats.items() if k.startswith("spec_")}
        outs = self.engine.generate(job.prompts, params)
        spec = {k: v - before.get(k, 0) for k, v in stats.items() if k.startswith("spec_")}
        return encode_completions(outs), time.perf_counter() - start, spec
