"""The stream's shape as data (pipeline/stream.py's stream_stages): which stages run, in which order, for a config,
each built with exactly the arguments the stream gives its kind, checked against its constructor before any actor
starts: a parameter renamed in a stage class is an error naming it, never a default taken in silence."""

import dataclasses
import inspect
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.stream import StreamInputs, generate_stage, stream_stages
from stages.generate import VLLMGenerate
from stages.reward_model import RewardModel
from stages.scored_generate import ScoredGenerate
from stages.sim.generate import SimGenerate

INPUTS = StreamInputs("model", "run", ("clock", "ns"), tables=None, owners={})
SIM = str(Path(__file__).resolve().parents[2] / "conf" / "sim" / "toy.yaml")


def _names(cfg) -> list[str]:
    return [stage.name for stage in stream_stages(cfg, INPUTS)]


def test_the_engine_scores_by_default():
    (gate, generate) = stream_stages(load_config(None), INPUTS)
    assert (gate.name, generate.name, generate.fn) == ("gate", "generate", ScoredGenerate)
    inner, _ = generate.kwargs["generate"]
    assert inner is VLLMGenerate
    assert [type(s).__name__ for s in generate.kwargs["scoring"]] == ["RewardSources", "GRPOAdvantage", "SampleLog"]


def test_a_reference_model_puts_its_stage_between_generation_and_scoring():
    got = _names(load_config(None, ["algorithm.use_kl_in_reward=true"]))
    assert got == ["gate", "generate", "ref_logprob", "RewardSources", "GRPOAdvantage", "SampleLog", "split"]
    assert _names(load_config(None, ["rollout.score_in_engine=false"])) == [
        "gate",
        "generate",
        "RewardSources",
        "GRPOAdvantage",
        "SampleLog",
        "split",
    ]


RM = ["reward.reward_model.enable=true", "reward.reward_model.model_path=/rm", "reward.reward_model.num_replicas=2"]


def test_a_reward_model_scores_in_actors_of_its_own_after_the_reference_model():
    """A reward model needs a stage between generation and scoring, so the engine no longer scores; the reward step
    reads its scores, and a reference model's logprobs come first."""
    stages = stream_stages(load_config(None, RM), INPUTS)
    assert [s.name for s in stages] == [
        "gate",
        "generate",
        "reward_model",
        "RewardSources",
        "GRPOAdvantage",
        "SampleLog",
        "split",
    ]
    (rm,) = [s for s in stages if s.name == "reward_model"]
    assert rm.fn is RewardModel and rm.kwargs["model_path"] == "/rm" and rm.options["compute"].min_size == 2
    assert rm.options["num_gpus"] == 0.0  # INPUTS' cluster has no GPU
    (step,) = [s for s in stages if s.name == "RewardSources"]
    assert step.fn.model_sources == ("reward_model",) and step.fn.rule is None
    with_ref = _names(load_config(None, [*RM, "algorithm.use_kl_in_reward=true"]))
    assert with_ref[:4] == ["gate", "generate", "ref_logprob", "reward_model"]
    on_gpus = stream_stages(load_config(None, RM), dataclasses.replace(INPUTS, cluster_gpus=2.0))
    assert [s.options["num_gpus"] for s in on_gpus if s.name == "reward_model"] == [1.0]


@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        (None, []),
        (None, RM),
        (None, ["algorithm.use_kl_in_reward=true", "algorithm.adv_estimator=reinforce_plus_plus"]),
        (SIM, ["rollout.score_in_engine=false"]),
    ],
)
def test_every_stage_is_built_with_arguments_its_constructor_takes(config, overrides):
    for stage in stream_stages(load_config(config, overrides), INPUTS):
        if isinstance(stage.fn, type):
            inspect.signature(stage.fn).bind(**stage.kwargs)
        if stage.fn is ScoredGenerate:
            cls, kwargs = stage.kwargs["generate"]
            inspect.signature(cls).bind(**kwargs)


def test_each_generate_class_gets_its_own_kinds_arguments():
    _, vllm = generate_stage(load_config(None), "model", ("clock", "ns"), 3)
    assert vllm["model_dir"] == "model" and vllm["initial_version"] == 3 and "sim" not in vllm
    cls, sim = generate_stage(load_config(SIM), "model", ("clock", "ns"), 0)
    assert cls is SimGenerate and "sim" in sim and "temperature" not in sim


def test_a_renamed_constructor_parameter_is_an_error_naming_it(tmp_path, monkeypatch):
    """VLLMGenerate's constructor with `temperature` renamed `temp`: the stream's `temperature` has nowhere to go."""
    signature = str(inspect.signature(VLLMGenerate.__init__)).replace("temperature", "temp")
    source = f"from __future__ import annotations\n\n\nclass Renamed:\n    def __init__{signature}:\n        pass\n"
    (tmp_path / "own_generate.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["stages.generate._target_=own_generate.Renamed"])
    with pytest.raises(ConfigError, match="own_generate.Renamed does not take .*'temperature'"):
        generate_stage(cfg, "model", ("clock", "ns"), 0)
