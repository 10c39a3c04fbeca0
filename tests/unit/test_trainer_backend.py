"""Every trainer backend answers the driver's calls (stages/trainer/backend.py) with compatible signatures."""

import inspect

import pytest

from stages.sim.trainer import SimTrainer
from stages.trainer.backend import TrainerBackend, WeightedBackend
from stages.trainer.fsdp_backend import FSDPTrainer
from stages.trainer.megatron_backend import MegatronTrainer
from stages.trainer.torch_backend import TorchTrainer


def _methods(protocol: type) -> dict[str, inspect.Signature]:
    names = {n for klass in protocol.__mro__ if klass is not object for n in vars(klass) if not n.startswith("_")}
    return {n: inspect.signature(getattr(protocol, n)) for n in names if callable(getattr(protocol, n))}


def _compatible(impl: inspect.Signature, spec: inspect.Signature) -> bool:
    """The implementation takes every parameter of the spec, by the same name, and needs no other."""
    given = [p for p in impl.parameters.values() if p.name != "self"]
    wanted = [p.name for p in spec.parameters.values() if p.name != "self"]
    required = [p.name for p in given if p.default is inspect.Parameter.empty]
    return [p.name for p in given[: len(wanted)]] == wanted and set(required) <= set(wanted)


@pytest.mark.parametrize(
    ("backend", "protocol"),
    [
        (TorchTrainer, WeightedBackend),
        (FSDPTrainer, WeightedBackend),
        (MegatronTrainer, WeightedBackend),
        (SimTrainer, TrainerBackend),
    ],
)
def test_backend_has_every_method_of_its_protocol(backend, protocol):
    methods = _methods(protocol)
    assert {"train_step", "push_weights", "publish_weights", "weight_meta"} <= set(methods)
    for name, spec in methods.items():
        assert hasattr(backend, name), f"{backend.__name__} lacks {name}"
        assert _compatible(inspect.signature(getattr(backend, name)), spec), (backend.__name__, name)


def test_a_missing_parameter_is_incompatible():
    def spec(self, url: str) -> None: ...

    def impl(self) -> None: ...

    assert not _compatible(inspect.signature(impl), inspect.signature(spec))
    assert _compatible(inspect.signature(spec), inspect.signature(spec))
