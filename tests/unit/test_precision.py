"""Where the trainer computes and in which precision (stages/trainer/precision.py), on CPU: bf16 compute over fp32
master weights gives the fp32 step within bf16's tolerance, really computes in bf16, and keeps the weights and AdamW's
state in fp32; the keys are verl's and a dtype the trainer cannot keep is refused with the key's name.

Tolerances of a bf16 step against the fp32 one (bench/gpu_check/trainer_step.py holds the same on a GPU): relative
2e-2 on the loss, 5e-2 on the gradient norm, update cosine at least 0.9.
"""

import pytest
import torch

from pipeline.config import ConfigError, load_config
from stages.trainer.precision import MixedPrecision, compute_dtype, pick_device
from stages.trainer.settings import PolicySettings
from stages.trainer.torch_backend import TorchTrainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from bench.gpu_check.models import build_dense

    return str(build_dense(tmp_path_factory.mktemp("model"), "tiny"))


def _step(model_dir: str, dtype: str) -> tuple[dict, list[torch.Tensor], TorchTrainer]:
    """One step on the fixed batch; its metrics, each parameter's change, the trainer."""
    from bench.gpu_check.models import batch

    trainer = TorchTrainer(
        model_dir, PolicySettings(lr=1e-3, micro_batch_size=2), mixed_precision=MixedPrecision(param_dtype=dtype)
    )
    start = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step([batch("tiny")])
    return metrics, [p.detach() - s for p, s in zip(trainer.model.parameters(), start, strict=True)], trainer


def test_a_bf16_step_is_the_fp32_step_within_bf16s_tolerance(model_dir):
    fp32, update32, _ = _step(model_dir, "fp32")
    bf16, update16, _ = _step(model_dir, "bf16")
    assert bf16["actor/pg_loss"] == pytest.approx(fp32["actor/pg_loss"], rel=2e-2)
    assert bf16["actor/grad_norm"] == pytest.approx(fp32["actor/grad_norm"], rel=5e-2)
    flat32, flat16 = torch.cat([u.flatten() for u in update32]), torch.cat([u.flatten() for u in update16])
    assert float(torch.nn.functional.cosine_similarity(flat16, flat32, dim=0)) >= 0.9
    assert bf16["actor/pg_loss"] != fp32["actor/pg_loss"]  # not the same computation: bf16 rounds


def test_bf16_computes_in_bf16_and_keeps_fp32_weights_and_optimizer_state(model_dir):
    _, _, trainer = _step(model_dir, "bf16")
    seen = []
    hook = trainer.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    trainer.logprobs([[1, 2, 3]], [[4, 5]])
    hook.remove()
    assert seen == [torch.bfloat16]
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    state = trainer.optimizer.state_dict()["state"]
    assert {t.dtype for s in state.values() for k, t in s.items() if k != "step"} == {torch.float32}


def test_fp32_stays_the_cpu_default_and_bf16_is_the_gpu_default():
    assert pick_device("cpu") == torch.device("cpu")
    assert compute_dtype(None, torch.device("cpu")) == torch.float32
    assert compute_dtype(None, torch.device("cuda", 0)) == torch.bfloat16
    assert compute_dtype("fp32", torch.device("cuda", 0)) == torch.float32
    if not torch.cuda.is_available():
        assert pick_device() == torch.device("cpu")


def test_the_keys_are_verls_and_what_cannot_be_kept_is_refused():
    cfg = load_config(
        None, ["actor.fsdp_config.mixed_precision.param_dtype=bf16", "actor.fsdp_config.model_dtype=fp32"]
    )
    assert cfg.actor.fsdp_config.mixed_precision.param_dtype == "bf16"
    with pytest.raises(ConfigError, match="param_dtype"):
        load_config(None, ["actor.fsdp_config.mixed_precision.param_dtype=fp16"])  # needs loss scaling: not offered
    with pytest.raises(ConfigError, match="buffer_dtype=bf16: the buffers stay fp32"):
        load_config(None, ["actor.fsdp_config.mixed_precision.buffer_dtype=bf16"])
    assert load_config(None, ["actor.megatron.dtype=bfloat16", "rollout.dtype=bfloat16"]).rollout.dtype == "bfloat16"


def test_megatron_bf16_on_cpu_is_refused_with_its_key(model_dir):
    from stages.trainer.megatron_backend import MegatronTrainer

    if torch.cuda.is_available():
        pytest.skip("on a GPU bf16 parameters are megatron's default")
    with pytest.raises(ValueError, match="set actor.megatron.dtype=float32 on CPU"):
        MegatronTrainer(model_dir, dtype="bfloat16")


def test_the_reference_model_in_bf16_is_close_to_fp32(model_dir):
    import pyarrow as pa

    from stages.ref_logprob import RefLogprob

    table = pa.table({"prompt_ids": [[1, 2, 3], [4, 5]], "response_ids": [[6, 7], [8, 9, 10]]})
    fp32 = RefLogprob(model_dir)(table).column("ref_logprobs").to_pylist()
    stage = RefLogprob(model_dir, dtype="bf16")
    assert stage.model.dtype == torch.bfloat16
    bf16 = stage(table).column("ref_logprobs").to_pylist()
    diffs = [abs(a - b) for r, q in zip(bf16, fp32, strict=True) for a, b in zip(r, q, strict=True)]
    assert 0 < max(diffs) <= 0.1
