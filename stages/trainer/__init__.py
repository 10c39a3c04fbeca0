"""Trainer backends (torch; Megatron on GPUs) and the trainer side of the weight sync."""
