"""MegatronTrainer: the megatron-core trainer backend (`trainer.backend: megatron`).

The driver talks to this one object (a Ray actor, like TorchTrainer) through the TrainerBackend calls. It is
tensor-parallel rank 0 itself; with `tensor_model_parallel_size > 1` it starts the other ranks as Ray actors
(`num_cpus=0`: two actors holding a CPU each deadlock a 2-core box, DESIGN.md §6) and makes every rank run each
call in the same order, since the ranks' forward, backward and weight gathers are collectives. The ranks form
their own torch.distributed world on 127.0.0.1 (gloo on CPU, NCCL on GPU), and the weight sync to the engines
uses a second, private group (stages/trainer/weight_sync.py), so the two never collide.

Data parallelism is not used (one replica of the model, split by TP); pipeline parallelism is refused by the
config check. Weights leave as HF names and layout (stages/trainer/megatron_convert.py), gathered across TP ranks
in buckets and streamed into the weight sync or the pull-mode safetensors file.
"""

from __future__ import annotations

import io
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import torch

from stages.trainer.megatron_rank import MegatronRank
from stages.trainer.settings import PolicySettings
from stages.trainer.weight_sync import make_weight_sync


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(refs: list) -> list:
    """The peers' results; with TP=1 there are none and Ray is not needed (tests build the trainer in-process)."""
    if not refs:
        return []
    import ray

    return ray.get(refs)


class MegatronTrainer:
    def __init__(
        self,
        model_dir: str,
        policy: PolicySettings | None = None,
        use_rollout_log_probs: bool = True,
        compute_prox_log_prob: bool = False,
        seed: int = 0,
        torch_threads: int = 1,
        optimizer_state: str | None = None,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        weight_sync_backend: str = "gloo",
        export_bucket_mb: int = 64,
        gpus_per_rank: float = 0.0,
        rank_resources: dict[str, float] | None = None,
    ) -> None:
        """`gpus_per_rank`, `rank_resources`: what each peer rank asks Ray for (ray.gpus_per_trainer_rank on a GPU
        cluster; a share of the trainer nodes' custom resource, pipeline/config/placement.py)."""
        if pipeline_model_parallel_size != 1:
            raise ValueError("megatron.pipeline_model_parallel_size > 1 is not supported yet: use tensor parallelism")
        kwargs = dict(
            tensor_model_parallel_size=tensor_model_parallel_size,
            policy=policy or PolicySettings(),
            seed=seed,
            torch_threads=torch_threads,
        )
        world, port = tensor_model_parallel_size, _free_port()
        self.peers = []
        if world > 1:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            # On this node: the ranks meet on 127.0.0.1, and a TP group's collectives want one node's links.
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            remote_rank = ray.remote(MegatronRank).options(
                num_cpus=0, num_gpus=gpus_per_rank, resources=rank_resources or {}, scheduling_strategy=here
            )
            self.peers = [remote_rank.remote(model_dir, r, world, port, **kwargs) for r in range(1, world)]
        self.rank = MegatronRank(model_dir, 0, world, port, **kwargs)  # joins the peers' rendezvous
        self.model_dir = Path(model_dir)
        self.recompute = compute_prox_log_prob or not use_rollout_log_probs
        self.bucket_bytes = export_bucket_mb << 20
        self.sync = make_weight_sync(weight_sync_backend)
        if optimizer_state:
            self._load_optimizer(optimizer_state)

    def _all(self, method: str, *args) -> Any:
        """Run `method` on every rank (peers first: they block in the first collective until rank 0 arrives)."""
        pending = [getattr(p, method).remote(*args) for p in self.peers]
        # An error on rank 0 propagates at once: waiting for peers stuck in a collective would turn it into a hang.
        result = getattr(self.rank, method)(*args)
        _wait(pending)
        return result

    # --- training --------------------------------------------------------------------------------------------
    def train_step(self, minibatches: list[dict[str, list]]) -> dict[str, float]:
        return self._all("train_step", minibatches, self.recompute)

    def logprobs(self, prompts: list, responses: list, routes: list | None = None) -> list[list[float]]:
        return self._all("logprobs", prompts, responses, routes)

    # --- weights out -------------------------------------------------------------------------------------------
    def _stream(self):
        """HF-named tensors from rank 0 while every peer takes part in the same bucket gathers."""
        pending = [p.drain_export.remote(self.bucket_bytes) for p in self.peers]
        yield from self.rank.export(self.bucket_bytes)
        _wait(pending)

    def open_weight_sync(self, world_size: int, connect_timeout_s: float = 30.0) -> dict[str, Any]:
        return self.sync.open(world_size, connect_timeout_s)

    def wait_weight_sync(self) -> None:
        self.sync.wait_open()

    def weight_meta(self) -> dict[str, list]:
        return self.rank.hf_meta()

    @torch.no_grad()
    def push_weights(self) -> dict[str, float]:
        start = time.monotonic()
        sent = self.sync.push(t for _, t in self._stream())
        return {"sync/bytes": float(sent), "sync/broadcast_s": time.monotonic() - start}

    @torch.no_grad()
    def publish_weights(self, url: str) -> dict[str, float]:
        """Pull mode: one safetensors file at `url` (any fsspec URL), written as TorchTrainer writes it."""
        start = time.monotonic()
        blob = self._safetensors()
        fs, path = fsspec.core.url_to_fs(url)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(path, "wb") as f:
            f.write(blob)
        return {"sync/bytes": float(len(blob)), "sync/publish_s": time.monotonic() - start}

    def _safetensors(self) -> bytes:
        from safetensors.torch import save

        # safetensors writes one header for all tensors, so the file needs them all at once (on CPU).
        return save({name: t.detach().cpu().contiguous().clone() for name, t in self._stream()})

    @torch.no_grad()
    def set_weight(self, name: str, value: float) -> None:
        """Fill the Megatron parameter behind one HF name with a constant (tests), on every rank."""
        self._all("fill_hf", name, value)

    # --- checkpoints -------------------------------------------------------------------------------------------
    def save_checkpoint(self, url: str) -> float:
        """`url`/model as an HF directory (what the engines and TorchTrainer load) and `url`/optimizer.pt holding
        every TP rank's AdamW state, in rank order."""
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp)
            (local / "model").mkdir()
            (local / "model" / "model.safetensors").write_bytes(self._safetensors())
            for f in self.model_dir.iterdir():  # config.json, tokenizer and any other side files
                if f.is_file() and f.suffix not in (".safetensors", ".bin") and not f.name.endswith(".index.json"):
                    (local / "model" / f.name).write_bytes(f.read_bytes())
            states = [self.rank.optimizer_state(), *_wait([p.optimizer_state.remote() for p in self.peers])]
            buf = io.BytesIO()
            torch.save({"megatron_tp_states": states}, buf)
            (local / "optimizer.pt").write_bytes(buf.getvalue())
            fs, root = fsspec.core.url_to_fs(url)
            for f in sorted(p for p in local.rglob("*") if p.is_file()):
                target = f"{root}/{f.relative_to(local).as_posix()}"
                fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                fs.put_file(str(f), target)
        return time.monotonic() - start

    def _load_optimizer(self, path: str) -> None:
        saved = torch.load(path, weights_only=True)
        states = saved.get("megatron_tp_states") if isinstance(saved, dict) else None
        if states is None or len(states) != 1 + len(self.peers):
            raise ValueError(
                f"{path} is not an optimizer state of a Megatron trainer with tensor_model_parallel_size="
                f"{1 + len(self.peers)}: resume with the backend and TP size the checkpoint was taken with"
            )
        self.rank.load_optimizer_state(states[0])
        _wait([p.load_optimizer_state.remote(s) for p, s in zip(self.peers, states[1:], strict=True)])
