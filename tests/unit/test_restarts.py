"""What a run does when a part of it dies: which errors mean the trainer died, when it may restart from a
checkpoint (and the config it restarts with), and the fault log's lines and counters."""

import json
import threading
from types import SimpleNamespace

import pytest
import ray

from pipeline import checkpoint
from pipeline.config import load_config
from pipeline.finish import RunFailed, restart_from_checkpoint, trainer_death
from pipeline.observe.faults import FaultLog
from stages.control import Done, Failed, JoinGroup
from stages.transports import GroupAddress, WeightMeta

TRAINER_ID = "ab" * 16


class FakeTrainer:
    _actor_id = SimpleNamespace(hex=lambda: TRAINER_ID)


def test_only_the_trainer_dying_counts_as_the_trainer_dying():
    died = ray.exceptions.RayActorError(actor_id=TRAINER_ID)
    other = ray.exceptions.RayActorError(actor_id="cd" * 16)  # the clock, say: not restartable this way
    rank = ray.exceptions.RayTaskError("train_step", "", ray.exceptions.RayActorError(actor_id="ef" * 16))
    assert trainer_death(died, FakeTrainer()) == "the trainer actor died"
    assert trainer_death(other, FakeTrainer()) is None
    assert "a trainer rank died" in trainer_death(rank, FakeTrainer())
    assert trainer_death(ValueError("a bug"), FakeTrainer()) is None
    assert trainer_death(died, None) is None  # died before the trainer started


def test_a_trainer_that_fails_to_start_is_reported_with_its_error_not_restarted(tmp_path):
    from pipeline.finish import failure

    tb = "Traceback (most recent call last):\n  File ...\nAttributeError: no attribute 'options'"
    init = ray.exceptions.RayTaskError("FSDPTrainer.__init__", tb, AttributeError("no attribute 'options'"))
    failed_start = ray.exceptions.ActorDiedError(init)
    failed_start.actor_id = TRAINER_ID
    assert failed_start.actor_init_failed and trainer_death(failed_start, FakeTrainer()) is None
    message = str(failure(SimpleNamespace(run_dir=tmp_path), failed_start))
    assert message.startswith("an actor's constructor failed: ActorDiedError:") and "no attribute 'options'" in message


def _ctx(tmp_path, *overrides):
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", "trainer.run_name=r", *overrides])
    run_dir = tmp_path / "r"
    run_dir.mkdir(exist_ok=True)
    return SimpleNamespace(cfg=cfg, run_dir=run_dir, checkpoint_root=str(run_dir / "checkpoints"))


def test_a_dead_trainer_restarts_from_the_latest_checkpoint_as_resume_would(tmp_path):
    ctx = _ctx(tmp_path, "trainer.save_freq=2", "trainer.max_restarts=1")
    with pytest.raises(RunFailed, match="before the first checkpoint"):
        restart_from_checkpoint(ctx, "the trainer actor died", 0)
    checkpoint.commit(ctx.checkpoint_root, 4, 4, [("e0-000001", 0, 1.0)], {})
    cfg = restart_from_checkpoint(ctx, "the trainer actor died", 0)
    assert cfg.resume and cfg.trainer.run_name == "r" and cfg.trainer.output_dir == str(tmp_path)
    (event,) = [json.loads(line) for line in (ctx.run_dir / "faults.jsonl").read_text().splitlines()]
    assert event["component"] == "trainer" and event["from_step"] == 4
    with pytest.raises(RunFailed, match=r"trainer.max_restarts=1\). Resume from step 4 with resume=true"):
        restart_from_checkpoint(ctx, "the trainer actor died", 1)


def test_without_checkpoints_the_message_says_how_to_make_the_run_resumable(tmp_path):
    with pytest.raises(RunFailed, match="the trainer actor died and this run keeps no checkpoint.*trainer.save_freq"):
        restart_from_checkpoint(_ctx(tmp_path), "the trainer actor died", 0)


def test_fault_log_writes_each_restart_once_and_counts_them(tmp_path, capsys):
    log = FaultLog(tmp_path, trainer_restarts=1, trainer_pid=7)
    event = {"replica": 0, "time": 1.0, "cause": "its actor process (pid 5) died", "readmitted_prompts": 2}
    members = [{"replica": 0, "pid": 9, "engine_pids": [10], "node": "n", "generation": 1}]
    clock = {"fault/engine_restarts": 1, "fault/readmitted_prompts": 2, "events": [event], "replicas": members}
    assert log.update(clock) == {
        "fault/engine_restarts": 1.0,
        "fault/readmitted_prompts": 2.0,
        "fault/trainer_restarts": 1.0,
    }
    assert log.seen == 1
    log.update({**clock, "events": []})  # the clock's next answer holds only newer events
    lines = (tmp_path / "faults.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["component"] == "generate replica 0"
    assert json.loads((tmp_path / "processes.json").read_text()) == {"trainer": 7, "replicas": members}
    assert "generate replica 0 restarted: its actor process (pid 5) died, 2 prompts" in capsys.readouterr().out


def test_an_unrecoverable_failure_is_one_line_naming_the_part_that_failed(tmp_path):
    from pipeline.finish import failure

    inner = RuntimeError("Generate replica 0 died and the replicas have already been restarted 3 times")
    err = ray.exceptions.RayTaskError("MapWorker(MapBatches(VLLMGenerate)).submit", "tb", inner)
    failed = failure(SimpleNamespace(run_dir=tmp_path), err)
    assert str(failed).startswith("MapWorker(MapBatches(VLLMGenerate)).submit failed: RuntimeError: Generate replica 0")
    assert "error.txt" in str(failed) and (tmp_path / "error.txt").read_text()


class _Trainer:
    """The trainer's side of push mode, scripted: the first group never forms (a member died as it joined)."""

    def __init__(self) -> None:
        self.opened: list[int] = []

    def open_weight_sync(self, world_size: int, connect_timeout_s: float) -> GroupAddress:
        self.opened.append(world_size)
        return GroupAddress("127.0.0.1", 1, "gloo", connect_timeout_s)

    def wait_weight_sync(self) -> None:
        if len(self.opened) == 1:
            raise RuntimeError("weight-sync group failed to form: timed out waiting for rank 2")

    def weight_meta(self) -> WeightMeta:
        return WeightMeta((), (), ())

    def push_weights(self) -> dict:
        return {"sync/bytes": 0.0}

    def history(self) -> list[int]:
        return self.opened


class _Clock:
    """Two replicas; replica 1 is gone by the time the first formation has failed."""

    def __init__(self) -> None:
        self.posted: list[tuple] = []  # (message, to)
        self.finished: list[int] = []

    def pause_admission(self) -> dict[int, int]:
        return self.members()

    def wait_replicas(self, timeout_s: float) -> int:
        return 2

    def members(self) -> dict[int, int]:
        return {0: 0, 1: 0} if not self.posted else {0: 0}

    def post(self, message, to: list[int]) -> int:
        self.posted.append((message, to))
        return len(self.posted)

    def wait_acks(self, seq: int, timeout_s: float) -> list:
        message, to = self.posted[seq - 1]
        if isinstance(message, JoinGroup) and seq == 1:
            return [Failed(0, "DistStoreError: timed out")]
        return [Done(r) for r in to]

    def finish_sync(self, version: int, snapshot=None) -> dict:
        self.finished.append(version)
        return {}

    def history(self) -> tuple[list[tuple], list[int]]:
        return self.posted, self.finished


def test_a_group_that_fails_to_form_is_formed_again_with_the_live_replicas(ray_session, tmp_path):
    import sys

    from ray import cloudpickle

    from pipeline.sync import Push

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import a test module
    trainer, clock = ray.remote(_Trainer).remote(), ray.remote(_Clock).remote()
    push = Push(trainer, clock, 2, tmp_path, connect_timeout_s=5.0)
    metrics = push.sync(1)
    posted, finished = ray.get(clock.history.remote())
    assert ray.get(trainer.history.remote()) == [3, 2]  # trainer + 2 replicas, then trainer + the survivor
    kinds = [(type(m).__name__, to) for m, to in posted]
    assert kinds == [("JoinGroup", [0, 1]), ("JoinGroup", [0]), ("PushWeights", [0])]
    assert all(m.address.connect_timeout_s == 5.0 for m, _ in posted[:2])
    assert finished == [1] and push.group == {0: 0} and "sync/trainer_blocked_s" in metrics


def test_processes_json_is_never_seen_half_written(tmp_path):
    # An operator or a fault-injection test reads it while the run rewrites it.
    log, seen, done = FaultLog(tmp_path), [], threading.Event()

    def read() -> None:
        while not done.is_set():
            if (path := tmp_path / "processes.json").exists():
                seen.append(json.loads(path.read_text())["replicas"][0]["generation"])

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for generation in range(300):
            member = {"replica": 0, "pid": 9, "engine_pids": [10], "node": "n", "generation": generation}
            log.update({"events": [], "replicas": [member]})
    finally:
        done.set()
        reader.join()
    assert seen and seen == sorted(seen)
    assert [p.name for p in tmp_path.iterdir()] == ["processes.json"]


def test_a_stage_error_as_ray_raises_it_is_reported_not_masked(tmp_path):
    from ray.exceptions import UserCodeException

    from pipeline.finish import failure

    # What a failing Ray Data stage raises: RayTaskError(UserCodeException), whose unknown attributes go to its cause
    cause = UserCodeException("UDF failed to process a data block.")
    err = ray.exceptions.RayTaskError("MapWorker(MapBatches(Reward)).submit", "tb", cause).as_instanceof_cause()
    message = str(failure(SimpleNamespace(run_dir=tmp_path), err))
    assert "UserCodeException: UDF failed to process a data block." in message and "error.txt" in message
