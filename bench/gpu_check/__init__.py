"""The GPU check (`make gpu-check`): the trainer-side GPU paths on one GPU, without Ray or vLLM, against the CPU.

Pieces, each a module run in a process of its own by __main__.py (process groups and megatron's state are global):
- trainer_step.py: TorchTrainer's step on the device in fp32 and bf16, single rank and FSDP2 as a one-rank world,
  against the same step on the CPU in fp32; the reference model's stage;
- megatron_step.py: MegatronTrainer at TP = PP = 1, megatron's own DDP, distributed optimizer and schedule on CUDA,
  against its CPU path; the loss lowered over a few steps;
- replay.py: R3 routing replay with both trainers on a tiny Qwen3-MoE;
- transport.py: the weight push (CUDA IPC on a GPU, gloo on CPU) into an engine worker's receiver in another process,
  checked tensor by tensor, timed against a device copy.
models.py holds the random models and the fixed batch, report.py the records, their checks and the table,
wheels.py what a bare GPU machine lacks. On CPU (`--device cpu --size tiny`) the same pieces are the check's
rehearsal, which the test suite runs.
"""
