"""The stream's stages, one class per file, each with its input and output columns in its docstring:
gate.py (StalenessGate: admission under the staleness budget of staleness.py), generate.py (VLLMGenerate) and
sim/generate.py (SimGenerate), each a replica (replica.py) around an engine (engines/), with agents/ and tools/ for
multi-turn loops; scored_generate.py (scoring in the engine's actor), ref_logprob.py (the frozen reference policy's
logprobs), reward.py (with verifiers.py and math_verifier.py), advantage/ (one estimator per file), sample_log.py,
handoff.py and sink.py (TrainingSink: steps in admission order). control.py is the control plane the replicas and
the gate share with the driver; transports/ the weight transports; trainer/ the trainer backends and their one
export-and-send; sim/ the simulated workload and trainer; ray_internals.py every use of a Ray internal.

Stages import only schemas/ and each other; the driver (pipeline/) wires them."""
