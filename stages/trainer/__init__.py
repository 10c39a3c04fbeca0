"""Trainer backends (torch, megatron-core, simulated), the interface the driver calls on them, and the trainer
side of the weight sync."""
