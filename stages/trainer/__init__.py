"""The trainer: torch_backend.py (TorchTrainer) and megatron_backend.py / megatron_rank.py / megatron_convert.py
(MegatronTrainer, tensor parallel), answering the calls of backend.py's TrainerBackend; what both share —
settings.py (the objective's knobs), step.py (mini-batch preparation, micro-batch loss, train metrics), loss.py (verl's
policy loss and aggregation), kl.py (KL estimators), correction.py (rollout correction) — and weight_sync.py, the
trainer's side of the push to the engines. The simulated trainer is stages/sim/trainer.py."""
