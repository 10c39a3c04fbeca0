"""Where the run's actors go on a Ray cluster (`ray.placement`), and whether the cluster can hold them at all.

A custom resource marks a kind of node (`ray start --resources='{"trainer": 1}'`). Every actor that belongs on such a
node asks for SHARE of it: a marker, not a limit (a thousand actors fit beside a `trainer: 1`), so Ray puts it on
one of those nodes and nowhere else. With placement on, the control actors (the version clock, the staleness gate)
ask for a share of `node:__internal_head__`, which Ray gives the head alone: the driver is there too (Ray Jobs starts
it on the head), and the gate calls the clock for every block. On one machine the cluster has no marked node, so
'auto' changes nothing there.

`check` compares what the layout asks for with the nodes' totals (not what is free now: a layout that waits for
another job's actors is not refused) and returns one message naming both. Without it an actor that no node can
hold waits for ever, and the run hangs without a word. The rules are necessary conditions, not a bin packing: every
bundle (what must share one node: an actor, a Megatron TP group, an engine's TP ranks) fits on some node that may
take it, and the bundles bound to a kind of node fit in those nodes' sum, as everything fits in the cluster's.

Pure: no Ray here. The driver reads the nodes (`ray.nodes()`) and sets each actor's options from a Placement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.config.schema import ConfigError, RayConfig, RunConfig

SHARE = 0.001
HEAD = "node:__internal_head__"
VLLM = "stages.generate.VLLMGenerate"
CPUS, HEAD_CPUS = "ray.num_cpus (a local Ray) or the nodes' --num-cpus", "the head's --num-cpus"
SPLIT_CPUS = 0.25  # each of the split stage's actors (stream.py), and each of the task stages fused into it
RM_CPUS = 0.5  # each reward-model replica: a fraction, so that it cannot deadlock a small machine
JUDGE_CPUS = 0.5  # each judge replica (its engine's processes are not Ray's to count), the same reason
# Resources the driver never asks for: not worth listing in a message.
_UNSHOWN = ("memory", "object_store_memory", "accelerator_type:")


@dataclass(frozen=True)
class Placement:
    """The custom resource each kind of actor asks for; empty: anywhere Ray puts it."""

    trainer: str = ""
    rollout: str = ""
    head: bool = False

    def trainer_resources(self) -> dict[str, float]:
        return {self.trainer: SHARE} if self.trainer else {}

    def rollout_resources(self) -> dict[str, float]:
        return {self.rollout: SHARE} if self.rollout else {}

    def head_resources(self) -> dict[str, float]:
        return {HEAD: SHARE} if self.head else {}


def resolve(ray_cfg: RayConfig, nodes: list[Mapping[str, float]]) -> Placement:
    """`ray.placement` against the cluster's nodes (each a map of resource totals)."""
    if ray_cfg.placement == "anywhere":
        return Placement()
    required = ray_cfg.placement == "required"

    def wanted(resource: str) -> str:
        return resource if required or any(n.get(resource, 0) > 0 for n in nodes) else ""

    trainer, rollout = wanted(ray_cfg.trainer_resource), wanted(ray_cfg.rollout_resource)
    return Placement(trainer, rollout, head=bool(trainer or rollout))


def engine_gpus(cfg: RunConfig, cluster_gpus: float) -> float:
    """GPUs a Generate replica asks for: `ray.gpus_per_engine` per tensor-parallel rank of a vLLM engine on a cluster
    with GPUs, else none. An engine over several GPUs holds them whole: Ray gives one actor its GPUs on one node, and
    vLLM's workers take the GPUs the actor sees, one each."""
    if cfg.stages.generate["_target_"] != VLLM or cluster_gpus <= 0:
        return 0.0
    tp, per_rank = cfg.rollout.tensor_model_parallel_size, cfg.ray.gpus_per_engine
    if tp > 1 and per_rank != 1:
        raise ConfigError(
            f"rollout.tensor_model_parallel_size={tp} runs each engine on {tp} whole GPUs, one per rank, and "
            f"ray.gpus_per_engine={per_rank:g} asks for {per_rank:g} GPU per rank: set ray.gpus_per_engine=1"
        )
    return tp * per_rank


def split_actors(cfg: RunConfig) -> int:
    """The stream's last stage's actors (stages.handoff.SplitTokens, with reward, advantage and sample log fused in):
    as many as the engines, at least two, on the rollout nodes, so that a block is scored and split beside the engine
    that made it. A fixed pool, not autoscaled: a retired actor would take the per-token tables it put with it."""
    return max(2, cfg.rollout.num_replicas)


def trainer_ranks(cfg: RunConfig) -> int:
    """Processes of the trainer: Megatron's TP x PP x DP grid, the torch backend's FSDP ranks, the sim's one."""
    t, mg = cfg.trainer, cfg.actor.megatron
    if t.backend == "megatron":
        return t.n_gpus_per_node * t.nnodes or mg.tensor_model_parallel_size * mg.pipeline_model_parallel_size
    return cfg.actor.fsdp_config.fsdp_size if t.backend == "torch" else 1


def trainer_threads(cfg: RunConfig) -> int:
    """trainer.torch_threads with null resolved: 0 (every core of the trainer's process, counted there) where one
    trainer process trains alone, the engines waiting for each sync (on-policy, a sync every step); else 1."""
    if cfg.trainer.torch_threads is not None:
        return cfg.trainer.torch_threads
    at = cfg.async_training
    alone = at.staleness_threshold == 0 and at.trigger_parameter_sync_step == 1 and trainer_ranks(cfg) == 1
    return 0 if alone else 1


def devices(cfg: RunConfig) -> tuple[int, int]:
    """The devices each side holds (GPUs on a GPU cluster): the trainer's ranks, and the engines' (replicas x TP)."""
    return trainer_ranks(cfg), cfg.rollout.num_replicas * cfg.rollout.tensor_model_parallel_size


def trainer_nodes(cfg: RunConfig) -> int:
    """Nodes the trainer's ranks span: trainer.nnodes for a multi-rank trainer laid out per node, else one."""
    return cfg.trainer.nnodes if cfg.trainer.n_gpus_per_node and trainer_ranks(cfg) > 1 else 1


def trainer_bundle(cfg: RunConfig, placement: Placement, cluster_gpus: float) -> dict[str, float]:
    """What one trainer node's ranks ask Ray for, together: a CPU for the rank that drives them (rank 0's node;
    the others keep one too, so every bundle is alike), their GPUs and their shares of the node marker."""
    per_node = trainer_ranks(cfg) // trainer_nodes(cfg)
    gpus = per_node * trainer_rank_gpus(cfg, cluster_gpus)
    bundle = {"CPU": 0.0 if cfg.trainer.backend == "sim" else 1.0, "GPU": gpus}
    bundle |= {placement.trainer: per_node * SHARE} if placement.trainer else {}
    return {k: v for k, v in bundle.items() if v > 0}


def megatron_data_parallel_size(cfg: RunConfig) -> int:
    """Model replicas of the Megatron trainer: its ranks over one replica's (TP x PP)."""
    mg = cfg.actor.megatron
    return trainer_ranks(cfg) // (mg.tensor_model_parallel_size * mg.pipeline_model_parallel_size)


def trainer_rank_gpus(cfg: RunConfig, cluster_gpus: float) -> float:
    """GPUs each trainer rank asks for: every trainer that holds weights (Megatron, FSDP, the torch backend's single
    rank) computes on a GPU when the cluster has them; the simulated one holds none."""
    return cfg.ray.gpus_per_trainer_rank if cfg.trainer.backend != "sim" and cluster_gpus > 0 else 0.0


def reference_gpus(cfg: RunConfig, cluster_gpus: float) -> float:
    """GPUs the reference model's actor asks for: ray.gpus_per_reference on a cluster with GPUs, else none."""
    return cfg.ray.gpus_per_reference if cluster_gpus > 0 else 0.0


@dataclass(frozen=True)
class Group:
    """`count` bundles of `bundle`: what must share one node (an actor, a TP group's ranks)."""

    name: str
    count: int
    bundle: dict[str, float]
    keys: str  # the config keys that size it, for the message
    on: str = ""  # the custom resource its nodes must have (from `bundle`); empty: any node
    spread: bool = False  # each bundle on a node of its own (a placement group's STRICT_SPREAD)

    def total(self, resource: str) -> float:
        return self.count * self.bundle.get(resource, 0.0)


def layout(cfg: RunConfig, placement: Placement, cluster_gpus: float, reference: bool) -> list[Group]:
    """What the run's actors ask Ray for, as prepare.py and stream.py ask it (`reference`: the stream computes
    reference logprobs)."""
    ranks, nodes = trainer_ranks(cfg), trainer_nodes(cfg)
    trainer = trainer_bundle(cfg, Placement(), cluster_gpus)  # the first rank's CPU; the peers ask for none
    engine = {"CPU": 1.0, "GPU": engine_gpus(cfg, cluster_gpus)}
    engines = cfg.rollout.num_replicas + (1 if cfg.async_training.use_trainer_do_validate else 0)
    engine_tp = cfg.rollout.tensor_model_parallel_size if engine["GPU"] else 1
    groups = [
        _group(
            _trainer_name(ranks, nodes),
            nodes,
            trainer,
            {placement.trainer: ranks // nodes * SHARE} if placement.trainer else {},
            "trainer.n_gpus_per_node, trainer.nnodes, actor.megatron.tensor_model_parallel_size, "
            "actor.megatron.pipeline_model_parallel_size, actor.fsdp_config.fsdp_size, ray.gpus_per_trainer_rank"
            if ranks > 1 or trainer.get("GPU")
            else "",
            spread=nodes > 1,
        ),
        _group(
            f"engine ({engine_tp} GPUs on one node)" if engine_tp > 1 else "engine",
            engines,
            engine,
            placement.rollout_resources(),
            "rollout.num_replicas, rollout.tensor_model_parallel_size, ray.gpus_per_engine"
            if engine["GPU"]
            else "rollout.num_replicas",
        ),
        _group("staleness gate", 1, {"CPU": 0.1}, placement.head_resources(), HEAD_CPUS if placement.head else CPUS),
    ]
    if not cfg.scores_in_engine():  # else the engines' actors score and split
        groups.append(
            _group(
                "split stage",
                split_actors(cfg),
                {"CPU": SPLIT_CPUS},
                placement.rollout_resources(),
                "rollout.num_replicas",
            )
        )
    if reference:
        ref = {"CPU": 0.5, "GPU": reference_gpus(cfg, cluster_gpus)}
        keys = "actor.use_kl_loss, algorithm.use_kl_in_reward" + (", ray.gpus_per_reference" if ref["GPU"] else "")
        groups.append(_group("reference model", 1, ref, {}, keys))
    rm = cfg.reward.reward_model
    if rm.enable:
        keys = "reward.reward_model.num_replicas" + (", reward.reward_model.gpus_per_replica" if cluster_gpus else "")
        groups.append(
            _group(
                "reward model", rm.num_replicas, {"CPU": RM_CPUS, "GPU": reward_model_gpus(cfg, cluster_gpus)}, {}, keys
            )
        )
    judge = cfg.reward.judge
    if judge.enable:
        keys = "reward.judge.num_replicas" + (", reward.judge.gpus_per_replica" if cluster_gpus else "")
        groups.append(
            _group("judge", judge.num_replicas, {"CPU": JUDGE_CPUS, "GPU": judge_gpus(cfg, cluster_gpus)}, {}, keys)
        )
    return groups


def judge_gpus(cfg: RunConfig, cluster_gpus: float) -> float:
    """GPUs each judge replica asks for: reward.judge.gpus_per_replica on a cluster with GPUs."""
    return cfg.reward.judge.gpus_per_replica if cluster_gpus > 0 else 0.0


def reward_model_gpus(cfg: RunConfig, cluster_gpus: float) -> float:
    """GPUs each reward-model replica asks for: reward.reward_model.gpus_per_replica on a cluster with GPUs."""
    return cfg.reward.reward_model.gpus_per_replica if cluster_gpus > 0 else 0.0


def _trainer_name(ranks: int, nodes: int) -> str:
    if nodes > 1:
        return f"trainer node ({ranks // nodes} of the trainer's {ranks} ranks, one node each)"
    return f"trainer ({ranks} ranks on one node)" if ranks > 1 else "trainer"


def _group(
    name: str, count: int, bundle: dict[str, float], custom: dict[str, float], keys: str, spread: bool = False
) -> Group:
    on = next(iter(custom), "")
    return Group(name, count, {k: v for k, v in {**bundle, **custom}.items() if v > 0}, keys, on, spread)


def check(groups: list[Group], nodes: list[Mapping[str, float]]) -> str | None:
    """None if the cluster may hold every group; else one message naming what is asked for and what is there."""
    groups = [g for g in groups if g.count > 0]
    problems: list[tuple[str, str]] = []  # (what is wrong, the keys that change it)
    for on in sorted({g.on for g in groups}):
        bound = [g for g in groups if g.on == on] if on else groups
        pool = [n for n in nodes if n.get(on, 0) > 0] if on else list(nodes)
        if not pool:
            names = " and the ".join(g.name for g in bound)
            problems.append((f"the {names} must go on nodes with `{on}`, and no node has it", _marker_keys(on)))
            continue
        too_big = [p for g in bound if g.on == on for p in [_fits_one_node(g, pool) or _spreads(g, pool)] if p]
        problems += too_big
        short = [r for r in ("CPU", "GPU") if sum(g.total(r) for g in bound) > _sum(pool, r) + 1e-9]
        if short and not too_big:
            asked = ", ".join(f"{g.count} x {g.name} ({describe_resources(g.bundle)})" for g in bound)
            where = _where(on) or "the cluster"
            need = ", ".join(f"{sum(g.total(r) for g in bound):g} {r}" for r in short)
            have = ", ".join(f"{_sum(pool, r):g} {r}" for r in short)
            problems.append((f"{asked} ask for {need} on {where}, which has {have}", _keys(bound)))
    if not problems:
        return None
    keys = sorted({k for _, ks in problems for k in ks.split(", ") if k})
    what = "; ".join(p for p, _ in problems)
    return (
        f"the Ray cluster cannot place this layout: {what}. Nodes: {describe_nodes(nodes)}. "
        f"Change {', '.join(keys)}, or add nodes; ray.placement=anywhere places the actors without the node markers"
    )


def _fits_one_node(group: Group, pool: list[Mapping[str, float]]) -> tuple[str, str] | None:
    need = {r: v for r, v in group.bundle.items() if r in ("CPU", "GPU")}
    if not need or any(all(n.get(r, 0.0) + 1e-9 >= v for r, v in need.items()) for n in pool):
        return None
    if group.on == HEAD:
        return f"{_a(group.name)} needs {describe_resources(need)} on the head, which has less", group.keys
    where = f" with `{group.on}`" if group.on else ""
    return f"{_a(group.name)} needs {describe_resources(need)} on one node{where}, and none has that much", group.keys


def _spreads(group: Group, pool: list[Mapping[str, float]]) -> tuple[str, str] | None:
    """A spread group's bundles each need a node of their own that holds one."""
    need = {r: v for r, v in group.bundle.items() if r in ("CPU", "GPU")}
    fit = [n for n in pool if all(n.get(r, 0.0) + 1e-9 >= v for r, v in need.items())]
    if not group.spread or len(fit) >= group.count:
        return None
    where = f" with `{group.on}`" if group.on else ""
    holds = f" that hold {describe_resources(need)} each" if need else ""
    return f"{group.count} x {group.name} need {group.count} nodes{where}{holds}, and there are {len(fit)}", group.keys


def _a(name: str) -> str:
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _keys(groups: list[Group]) -> str:
    return ", ".join(g.keys for g in groups)


def _marker_keys(on: str) -> str:
    return HEAD_CPUS if on == HEAD else "ray.trainer_resource, ray.rollout_resource, ray.placement"


def _sum(nodes: list[Mapping[str, float]], resource: str) -> float:
    return sum(n.get(resource, 0.0) for n in nodes)


def _where(on: str) -> str:
    return "" if not on else "the head" if on == HEAD else f"nodes with `{on}`"


def describe_resources(r: Mapping[str, float]) -> str:
    shown = {k: v for k, v in r.items() if k in ("CPU", "GPU") or not k.startswith(_UNSHOWN + ("node:",))}
    shown = {k: v for k, v in shown.items() if k in ("CPU", "GPU") or v >= 1}  # an actor's marker share is noise
    return ", ".join(f"{v:g} {k}" for k, v in sorted(shown.items())) or "0 CPU"


def describe_nodes(nodes: list[Mapping[str, float]]) -> str:
    return "; ".join(f"{'head' if HEAD in n else f'node {i}'}: {describe_resources(n)}" for i, n in enumerate(nodes, 1))
