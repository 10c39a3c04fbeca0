"""Inference engines behind the Generate replicas: base.py's `Engine` (the calls a replica makes), vllm.py (an async
vLLM engine, with vllm_core.py starting its engine-core process, vllm_worker.py inside its workers and vllm_routes.py
for MoE routes) and sim.py (a simulated one that spends the workload's time). The replica protocol around them is
stages/replica.py."""
