"""The cluster manifests parse, pass their schema, split the GPUs as described, and their job loads as a config."""

import json
import shlex
from pathlib import Path

import pytest
import yaml

from pipeline.config import CONF_DIR, load_config

ROOT = Path(__file__).resolve().parents[2]
RAYJOB = ROOT / "infra" / "k8s" / "rayjob.yaml"
LAUNCHER = ROOT / "infra" / "cluster" / "gpu.yaml"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def entrypoints() -> dict[str, str]:
    return {
        "rayjob": load(RAYJOB)["spec"]["entrypoint"],
        "launcher": load(LAUNCHER)["metadata"]["asyncrl_entrypoint"],
    }


@pytest.mark.parametrize("name", ["rayjob", "launcher"])
def test_job_overrides_load_as_a_config(name):
    argv = shlex.split(entrypoints()[name])
    assert argv[:2] == ["asyncrl", "run"]
    config, overrides = Path(argv[2]), argv[3:]
    local = CONF_DIR / config.name  # the image's /app/conf is this conf/
    assert local.exists(), f"{config} is not a shipped config"
    cfg = load_config(local, overrides)
    assert overrides, "the manifest's job should set its model, data and output"
    assert cfg.model.path != "embedded" and cfg.data.train_files != "embedded"
    assert Path(cfg.trainer.output_dir).is_absolute()  # on the shared volume, not in a pod's working dir


def test_both_manifests_run_the_same_job():
    rayjob, launcher = (shlex.split(e)[3:] for e in entrypoints().values())
    strip = ("model.path=", "data.train_files=", "trainer.output_dir=")  # mount points differ
    assert [o for o in rayjob if not o.startswith(strip)] == [o for o in launcher if not o.startswith(strip)]


def test_rayjob_splits_trainer_and_rollout_gpus():
    spec = load(RAYJOB)
    assert spec["apiVersion"] == "ray.io/v1" and spec["kind"] == "RayJob"
    cluster = spec["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"trainer", "rollout"}
    for name, group in groups.items():
        # KubeRay passes the value to `ray start --resources` as it is: a quoted JSON string
        assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {name: 1}
        (container,) = group["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) > 0


def test_launcher_config_passes_rays_schema():
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(load(LAUNCHER), schema)


def test_launcher_splits_trainer_and_rollout_and_keeps_the_dashboard_on_loopback():
    config = load(LAUNCHER)
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"] == {"GPU": 0}
    assert types["trainer"]["resources"] == {"trainer": 1}
    assert types["rollout"]["resources"] == {"rollout": 1}
    (start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in start


def rayjob_nodes() -> list[dict[str, float]]:
    """The RayJob's nodes as Ray would report their totals: the pods' CPU and GPU limits, the groups' markers."""
    from pipeline.config.placement import HEAD

    cluster = load(RAYJOB)["spec"]["rayClusterSpec"]
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    nodes = [{"CPU": float(head["resources"]["limits"]["cpu"]), "GPU": 0.0, HEAD: 1.0}]
    for group in cluster["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        marks = json.loads(json.loads(group["rayStartParams"]["resources"]))
        node = {"CPU": float(limits["cpu"]), "GPU": float(limits["nvidia.com/gpu"]), **marks}
        nodes += [node] * group["replicas"]
    return nodes


@pytest.mark.parametrize("name", ["rayjob", "launcher"])
def test_the_job_places_trainer_and_engines_on_the_marked_nodes(name):
    from pipeline.config.placement import check, layout, resolve

    argv = shlex.split(entrypoints()[name])
    cfg = load_config(CONF_DIR / Path(argv[2]).name, argv[3:])
    assert cfg.ray.placement == "required"  # a cluster without the marked nodes fails at start instead
    nodes = rayjob_nodes()  # the launcher's node types carry the same markers (test above)
    where = resolve(cfg.ray, nodes)
    assert {where.trainer, where.rollout} == {"trainer", "rollout"} and where.head
    assert check(layout(cfg, where, sum(n["GPU"] for n in nodes), reference=False), nodes) is None
