"""The trainer: torch_backend.py (TorchTrainer; fsdp_backend.py / fsdp.py / balance.py its FSDP2 data parallelism,
FSDPTrainer) and megatron_backend.py / megatron_rank.py / megatron_convert.py
(MegatronTrainer, tensor parallel; megatron_moe.py its MoE models), answering the calls of backend.py's
TrainerBackend; what both share — settings.py (the objective's knobs), step.py (mini-batch preparation, micro-batch
loss, train metrics), loss.py (verl's policy loss and aggregation), kl.py (KL estimators), correction.py (rollout
correction) — MoE routing replay (hf_router_replay.py for TorchTrainer, megatron_moe.py for Megatron) and
weight_sync.py, the trainer's side of the push to the engines. The simulated trainer is stages/sim/trainer.py."""
