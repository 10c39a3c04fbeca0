"""verl's fully_async example scripts load as written: every key of every script is handled (a key of the schema, a
verl key noted as having no effect, or one refused naming the capability it asks for; the trainer-efficiency keys are
left to their own settings), the DAPO 7B recipe scaled to the embedded task loads whole and means what it means in
verl, and the rule for keys of things asyncrl does not have is kept: noted when they only tune something not in use,
an error naming the capability when they ask for it."""

import inspect
import json
from types import SimpleNamespace

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.config.verl_keys import RULES
from stages.engines.vllm import VLLMEngine
from stages.generate import VLLMGenerate
from tests.verl_recipes import classify, recipe, recipes

DAPO_7B = "dapo_7b_math_fsdp2_8_8"
# The DAPO 7B recipe's sizes scaled to the embedded task on CPU: its own model and data, one engine, short
# responses (the overlong buffer scaled with them), mini-batches of 4 prompts, a few dozen steps.
CPU_SCALE = [
    "actor_rollout_ref.model.path=embedded",
    "data.train_files=embedded",
    "data.val_files=embedded",
    "data.max_prompt_length=64",
    "data.max_response_length=48",
    "+reward.reward_kwargs.overlong_buffer_cfg.len=16",
    "+reward.reward_kwargs.max_resp_len=48",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.optim.lr=5e-4",
    "rollout.total_rollout_steps=256",
    "trainer.n_gpus_per_node=0",
    "trainer.nnodes=1",
    "rollout.n_gpus_per_node=1",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size=1",
    "trainer.logger=[console]",
]


def _scaled(name: str) -> list[str]:
    """The recipe's overrides without the trainer-efficiency keys, then the CPU scale (later overrides win)."""
    scaled_keys = {o.split("=", 1)[0].lstrip("+") for o in CPU_SCALE}
    kept = [
        o
        for o in recipe(name)[1]
        if classify(o)[0] != "efficiency" and o.split("=", 1)[0].lstrip("+") not in scaled_keys
    ]
    return kept + CPU_SCALE


@pytest.mark.parametrize("name", recipes())
def test_every_key_of_every_script_is_handled(name):
    kinds = {o: classify(o) for o in recipe(name)[1]}
    unknown = [o for o, (kind, _) in kinds.items() if kind == "unknown"]
    assert not unknown, unknown


def test_the_dapo_7b_recipe_loads_scaled_to_cpu_and_means_what_verl_means():
    cfg = load_config(None, _scaled(DAPO_7B))
    a, ro, rc = cfg.actor, cfg.rollout, cfg.algorithm.rollout_correction
    # the objective: DAPO's clip-higher, dual clip 10, token-mean, no KL
    assert (a.clip_low, a.clip_high, a.clip_ratio_c, a.loss_agg_mode) == (0.2, 0.28, 10.0, "token-mean")
    assert (a.use_kl_loss, cfg.algorithm.use_kl_in_reward, a.weight_decay, a.grad_clip) == (False, False, 0.1, 1.0)
    assert a.optim.lr_warmup_steps == 10 and a.policy_loss.loss_mode == "vanilla"
    # the reward: the dapo manager and its overlong buffer (scaled)
    manager = cfg.reward_manager()
    assert (manager.name, manager.overlong.enable, manager.overlong.len, manager.max_resp_len) == ("dapo", True, 16, 48)
    # the async knobs, validation, sampling
    at = cfg.async_training
    assert (at.staleness_threshold, at.trigger_parameter_sync_step, at.require_batches, at.partial_rollout) == (
        0.1,
        4,
        4,
        True,
    )
    assert rc.bypass_mode and not at.compute_prox_log_prob  # verl's fully_async default: the engine's logprobs
    assert (ro.test_freq, cfg.trainer.val_before_train, ro.val_kwargs.top_p, ro.top_k) == (10, True, 0.7, -1)
    assert ro.engine_args()["enable_chunked_prefill"] is True and ro.gpu_memory_utilization == 0.8
    assert (cfg.data.truncation, cfg.data.prompt_key, cfg.trainer.resume_mode) == ("left", "prompt", "auto")
    assert cfg.trainer.project_name == "DAPO" and cfg.trainer.run_name.startswith("DAPO-Qwen2.5-7b")
    assert cfg.model.override_config == {"max_position_embeddings": 32768}
    assert ro.num_replicas == 1 and cfg.trainer.monitor == ["console"]
    # what has no effect here is said once, with why
    noted = {n.split("=", 1)[0] for n in cfg.notices}
    assert {"critic.strategy", "actor_rollout_ref.hybrid_engine", "data.return_raw_chat", "rollout.mode"} <= noted
    assert {"data.train_batch_size", "trainer.total_epochs", "rollout.calculate_log_probs"} <= noted
    assert all(": accepted" in n for n in cfg.notices)


@pytest.mark.parametrize(
    ("override", "capability"),
    [
        ("actor_rollout_ref.rollout.name=sglang", "an inference engine other than vLLM"),
        ("actor_rollout_ref.model.mtp.enable=True", "multi-token prediction"),
        ("actor_rollout_ref.model.lora_rank=64", "LoRA adapters"),
        ("actor_rollout_ref.rollout.quantization=fp8", "a quantized engine"),
        ("trainer.device=npu", "a device other than CUDA GPUs or the CPU"),
        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=8", "Ulysses sequence parallelism"),
        ("actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01", "an MoE load-balancing loss"),
        ("data.image_key=images", "image inputs"),
    ],
)
def test_a_key_asking_for_a_missing_capability_is_an_error_naming_it(override, capability):
    with pytest.raises(ConfigError, match=f"asks for {capability}"):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("+actor_rollout_ref.rollout.engine_kwargs.sglang.cuda_graph_max_bs=128", "the engine is vLLM"),
        ("+actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_timeout_iters=32", "the engine is vLLM"),
        ("actor_rollout_ref.model.mtp.speculative_num_steps=4", "multi-token prediction, which is off"),
        ("actor_rollout_ref.model.mtp.enable=False", "does not ask for multi-token prediction"),
        ("critic.strategy=fsdp2", "no critic"),
        ("actor_rollout_ref.ref.fsdp_config.forward_prefetch=True", "the reference model is its own stage"),
        ("actor_rollout_ref.actor.megatron.override_transformer_config.use_flash_attn=True", "kernel choice"),
        ("async_training.dynamic_schedule_policy=default", "dynamic resource scheduling, which is off"),
    ],
)
def test_a_key_that_only_tunes_something_not_in_use_is_noted_once(override, why):
    cfg = load_config(None, [override])
    assert len(cfg.notices) == 1 and why in cfg.notices[0], cfg.notices


def test_the_engine_kwargs_of_vllm_reach_the_engine_and_verls_knobs_with_them():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
            "actor_rollout_ref.rollout.enforce_eager=False",
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_mode=FULL_DECODE_ONLY",
        ],
    )
    args = cfg.rollout.engine_args()
    assert args["max_num_batched_tokens"] == 1024 and args["enforce_eager"] is False
    assert args["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"} and not cfg.notices


def test_on_a_gpu_the_engine_takes_verls_batch_and_cuda_graphs_and_on_cpu_vllms_batch_eagerly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    args = load_config(None).rollout.engine_args()
    assert not {"enforce_eager", "max_num_seqs", "max_num_batched_tokens"} & set(args)  # the engine decides by device
    on_gpu, on_cpu = (engine(tmp_path, gpu, args).kwargs for gpu in (True, False))
    assert (on_gpu["enforce_eager"], on_gpu["max_num_seqs"], on_gpu["max_num_batched_tokens"]) == (False, 256, 8192)
    assert on_cpu["enforce_eager"] is True and not {"max_num_seqs", "max_num_batched_tokens"} & set(on_cpu)
    keys = ["enforce_eager=True", "max_num_seqs=64", "max_num_batched_tokens=1024"]
    forced = load_config(None, [f"actor_rollout_ref.rollout.{k}" for k in keys]).rollout.engine_args()
    kwargs = engine(tmp_path, True, forced).kwargs  # the keys win on either device
    assert (kwargs["enforce_eager"], kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]) == (True, 64, 1024)
    # Without chunked prefill vLLM needs a whole prompt in a step: the default budget grows to the context length.
    unchunked = load_config(None, ["actor_rollout_ref.rollout.enable_chunked_prefill=False"]).rollout.engine_args()
    assert engine(tmp_path, True, unchunked, max_model_len=20_000).kwargs["max_num_batched_tokens"] == 20_000
    assert engine(tmp_path, True, args, max_model_len=20_000).kwargs["max_num_batched_tokens"] == 8192
    hooked = VLLMEngine(
        str(tmp_path), 0, 256, engine_args=args, launcher=SimpleNamespace(gpu=True), routed_experts_capture="hook"
    )
    assert hooked.kwargs["enforce_eager"] is True  # the router hook runs in Python at every forward


def test_the_engines_gpu_share_is_verls_standalone_one_over_the_shared_one_and_defaults_to_verls_half():
    key = "actor_rollout_ref.rollout."
    both = load_config(None, [f"{key}gpu_memory_utilization=0.5", f"{key}standalone_gpu_memory_utilization=0.85"])
    assert both.rollout.engine_gpu_share() == 0.85 and not both.notices  # every engine here is standalone
    assert load_config(None, [f"{key}gpu_memory_utilization=0.7"]).rollout.engine_gpu_share() == 0.7
    assert load_config(None).rollout.engine_gpu_share() is None  # left to the stage (or a preset's keyword) ...
    share = inspect.signature(VLLMGenerate).parameters["gpu_memory_utilization"].default
    assert share == 0.5 == inspect.signature(VLLMEngine).parameters["gpu_memory_utilization"].default  # ... verl's
    with pytest.raises(ConfigError, match="standalone_gpu_memory_utilization"):
        load_config(None, [f"{key}standalone_gpu_memory_utilization=1.5"])


def test_verls_cudagraph_capture_sizes_reach_vllms_compilation_config_over_the_engine_kwargs():
    base = ["actor_rollout_ref.rollout.cudagraph_capture_sizes=[8,16]"]
    args = load_config(None, base).rollout.engine_args()
    assert args["compilation_config"] == {"cudagraph_capture_sizes": [8, 16]}
    for kwargs in ('{"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1]}', {"cudagraph_mode": "PIECEWISE"}):
        cfg = load_config(None, base)
        cfg.rollout.engine_kwargs.vllm["compilation_config"] = kwargs  # a JSON string, as verl's scripts may give
        assert cfg.rollout.engine_args()["compilation_config"] == {
            "cudagraph_mode": "PIECEWISE",
            "cudagraph_capture_sizes": [8, 16],
        }


TINY_CONFIG = {
    "eos_token_id": 2,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 20_000,
}


def engine(model_dir, gpu: bool, engine_args: dict, max_model_len: int = 256):
    """A VLLMEngine as its replica would make it, without starting it (no vLLM import): `gpu` is its device."""
    launcher = SimpleNamespace(gpu=gpu)
    return VLLMEngine(str(model_dir), 0, max_model_len, engine_args=engine_args, launcher=launcher)


def test_vllms_stats_are_off_by_default_as_in_verl_and_its_key_turns_them_on():
    assert load_config(None).rollout.engine_args()["disable_log_stats"] is True
    on = load_config(None, ["actor_rollout_ref.rollout.disable_log_stats=False"])
    assert on.rollout.engine_args()["disable_log_stats"] is False and not on.notices


def test_a_config_file_without_async_keys_gets_verls_fully_async_defaults(tmp_path):
    """verl 0.9.1's fully_async_ppo_trainer.yaml: staleness 0.1, trigger 4, require_batches 1, partial rollout on,
    16 prompts a replica; a YAML that leaves them out means what it would mean to verl."""
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  ppo_mini_batch_size: 8\n")
    at = load_config(path).async_training
    got = (at.staleness_threshold, at.trigger_parameter_sync_step, at.require_batches, at.partial_rollout)
    assert got + (at.concurrent_samples_per_replica,) == (0.1, 4, 1, True, 16)


def test_verls_bound_on_prompts_generating_at_once_takes_its_key_and_default():
    from stages.staleness import StalenessBudget

    assert load_config(None).async_training.concurrent_samples_per_replica == 16  # verl's fully_async default
    cfg = load_config(None, ["async_training.concurrent_samples_per_replica=3", "rollout.num_replicas=2"])
    assert StalenessBudget.from_config(cfg).max_concurrent_samples == 6 and not cfg.notices  # min(2 x 3, B = 12)
    with pytest.raises(ConfigError, match=r"concurrent_samples_per_replica must be >= 1"):
        load_config(None, ["async_training.concurrent_samples_per_replica=0"])


def test_verls_run_keys_map_onto_ours():
    cfg = load_config(
        None,
        [
            "trainer.project_name=P",
            "trainer.experiment_name=E",
            "trainer.default_local_dir=/ckpt",
            "trainer.test_freq=5",
            "data.val_files=embedded",
            "rollout.nnodes=2",
            "rollout.n_gpus_per_node=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=False",
            "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        ],
    )
    t, ro = cfg.trainer, cfg.rollout
    assert (t.project_name, t.run_name, t.checkpoint_dir, ro.test_freq) == ("P", "E", "/ckpt", 5)
    assert ro.num_replicas == 4  # 2 nodes x 4 devices / TP 2
    assert ro.val_kwargs.temperature == 0.0  # do_sample=false is greedy
    with pytest.raises(ConfigError, match="set one setting two ways"):
        load_config(None, ["trainer.experiment_name=E", "trainer.run_name=F"])
    with pytest.raises(ConfigError, match="resume_path"):
        load_config(None, ["trainer.resume_mode=resume_path"])
    with pytest.raises(ConfigError, match="Weights & Biases is not supported"):
        load_config(None, ["trainer.logger=[console,wandb]"])


def test_every_rule_has_a_reason():
    assert all(len(rule.why) > 10 for rule in RULES.values())


def test_model_override_config_writes_a_config_of_the_run_and_leaves_the_model_alone(tmp_path):
    from pipeline.tasks.model_overrides import apply_overrides

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "rope": {"theta": 1, "x": 2}}))
    (model / "model.safetensors").write_bytes(b"weights")
    out = apply_overrides(model, {"max_position_embeddings": 32768, "rope": {"theta": 5}}, tmp_path / "run")
    assert json.loads((out / "config.json").read_text()) == {
        "max_position_embeddings": 32768,
        "rope": {"theta": 5, "x": 2},
    }
    assert (out / "model.safetensors").read_bytes() == b"weights" and (out / "model.safetensors").is_symlink()
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == 4096  # untouched
    assert apply_overrides(model, {}, tmp_path / "run") == model
