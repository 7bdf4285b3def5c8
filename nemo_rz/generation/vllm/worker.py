"""Worker extension: `LLM(worker_extension_cls="nemo_rz.generation.vllm.worker.NemoRZWorkerExtension")`.

vLLM mixes this class into its worker class, so these methods can be called by name through
`LLM.collective_rpc`. Names carry a `nemo_rz_` prefix (vLLM refuses clashes with the worker's own names).
Tensors cannot travel as RPC arguments; a state dict travels as safetensors bytes, which are bit-exact.
"""
from __future__ import annotations

import hashlib

import torch


class NemoRZWorkerExtension:
    def _nemo_rz_model(self):
        return self.model_runner.model  # type: ignore[attr-defined]

    def nemo_rz_load_weights(self, blob: bytes, version: int) -> int:
        """Load a state dict serialized with `safetensors.torch.save` (HF names); returns the tensors loaded."""
        from safetensors.torch import load

        state = load(blob)
        with torch.no_grad():
            loaded = self._nemo_rz_model().load_weights(state.items())
        self.nemo_rz_version = int(version)
        return len(loaded)

    def nemo_rz_weights_digest(self) -> str:
        """sha256 over the model's parameters (names and bytes), to check what a worker holds."""
        h = hashlib.sha256()
        for name, p in sorted(self._nemo_rz_model().named_parameters()):
            h.update(name.encode())
            h.update(p.detach().float().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def nemo_rz_info(self) -> dict:
        """What the worker runs with: torch threads, kernel set and temperature of the model, and the shape of
        each layer's KV cache tensor (empty before vLLM allocated them)."""
        m = self._nemo_rz_model()
        caches = []
        for layer in getattr(m, "kv_layers", []):
            kv = layer.kv_cache
            kv = kv[0] if isinstance(kv, (list, tuple)) and kv else kv
            if isinstance(kv, torch.Tensor) and kv.numel():
                caches.append(tuple(kv.shape))
        return {"threads": torch.get_num_threads(), "kernels": getattr(m, "kernels", None),
                "temperature": getattr(m, "temperature", None), "model": type(m).__name__, "kv_caches": caches}

    def nemo_rz_set_kernels(self, kernels: str) -> str:
        """Switch the model's nemo_rz.ops kernel set ("consistent" | "fast"); the caller resets the prefix cache
        (its keys were computed by the other set). Returns the set now in use."""
        from nemo_rz import ops

        if kernels not in ops.KERNELS:
            raise ValueError(f"nemo_rz_set_kernels: {kernels!r}: use one of {', '.join(ops.KERNELS)}")
        self._nemo_rz_model().kernels = kernels
        return kernels
