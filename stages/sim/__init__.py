"""The simulated Generate stage and trainer: they answer the stream exactly as VLLMGenerate and TorchTrainer do (the
same replica, on stages/engines/sim.py's engine) but spend the time a workload (workload.py: lengths, slots,
per-token times, sync cost) gives, so the real gate, versions, partial rollout, sink and audit run at a cluster's
shape in seconds."""
