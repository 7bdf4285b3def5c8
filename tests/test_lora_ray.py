"""LoRA on the Ray back-end: the frozen base goes into the object store once, each weight version carries the
adapters alone (RayBackend.publish's bytes), and the Ray run keeps 0 kernel mismatch. Negative control: a full
fine-tuning bundle through the same publish ships every tensor with every version."""
import json

import pytest
import torch
from test_lora import TINY

from nemo_rz import config
from nemo_rz.models import lora


def _nbytes(d):
    return sum(v.numel() * v.element_size() for v in d.values())


@pytest.mark.slow  # a Ray cluster's start, as the other Ray tests
def test_a_ray_lora_run_ships_the_adapters_alone_with_zero_kernel_mismatch(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    from nemo_rz.runtime import ray_backend
    from nemo_rz.runtime.trainer import Trainer

    seen = {}
    publish = ray_backend.RayBackend.publish

    def recording(self, version, state_dict):
        seen["backend"] = self
        if "control" not in seen:  # a full fine-tuning bundle (no adapter names): nothing is static
            full = {k: v for k, v in state_dict.items() if not lora.is_adapter(k)}
            probe = ray_backend.RayBackend.__new__(ray_backend.RayBackend)
            probe.ray, probe.ring_slots, probe.refs, probe.shipped = self.ray, 1, {}, {}
            probe.static_ref, probe.static_names, probe.static_bytes = None, frozenset(), 0
            seen["control"] = (publish(probe, 0, full), publish(probe, 1, full), _nbytes(full))
        return publish(self, version, state_dict)

    monkeypatch.setattr(ray_backend.RayBackend, "publish", recording)
    run = tmp_path / "r"
    run.mkdir()
    cfg = config.load(None, TINY + [f"run_dir={run}", "runtime.backend=ray", "runtime.rollout_workers=1", "lora.rank=4",
                                    "lora.modules=q_proj,v_proj"])
    trainer = Trainer(cfg, run, log=lambda *_: None)
    summary = trainer.run()
    assert summary["updates"] == 3
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["kernel_diff_tokens"] for r in records] == [0, 0, 0]
    adapters = lora.adapter_state(trainer.model)
    base = {k: v for k, v in trainer.model.state_dict().items() if not lora.is_adapter(k)}
    backend = seen["backend"]
    assert sorted(backend.shipped) == [0, 1, 2, 3]
    assert set(backend.shipped.values()) == {_nbytes(adapters)}, backend.shipped
    assert backend.static_bytes == _nbytes(base) > 20 * _nbytes(adapters)
    assert backend.static_names == set(base)
    assert any(torch.count_nonzero(v) for k, v in adapters.items() if "lora_B" in k)  # the adapters did move
    first, second, full = seen["control"]
    assert first == second == full  # negative control: without adapters every version ships the whole model
