"""The stream's stages, one class per file, each with its input and output columns in its docstring:
gate.py (StalenessGate: admission under the staleness budget of staleness.py), generate.py (VLLMGenerate, with
agents/ and tools/ for multi-turn loops, vllm_worker.py inside the engine), ref_logprob.py (the frozen reference
policy's logprobs), reward.py (with verifiers.py and math_verifier.py), advantage/ (one estimator per file),
sample_log.py, and sink.py (TrainingSink: steps in admission order). trainer/ holds the trainer backends and the
trainer's side of the weight sync; sim/ the simulated engine and trainer.

Stages import only schemas/ and each other; the driver (pipeline/) wires them."""
