"""bench.cpu_share: the kinds of a run's processes, and cores per kind over a window of samples."""

import collections
import subprocess
import sys

import pytest

from bench.cpu_share import DRIVER, Sampler, cores_between, kind_of


@pytest.mark.parametrize(
    "cmdline, kind",
    [
        ("VLLM::Worker", "vLLM worker (the model)"),
        ("VLLM::EngineCore", "vLLM engine core (scheduler; with one CPU rank also the model)"),
        (
            "/v/bin/python -c from multiprocessing.forkserver import main; main(13, 14, ['vllm.v1.engine.core'], **{})",
            "the engine core's forkserver (start-up)",
        ),
        ("ray::MapWorker(MapBatches(VLLMGenerate)).submit", "Generate actor (engine client)"),
        ("ray::MapWorker(MapBatches(StalenessGate))", "gate actor"),
        ("ray::MapWorker(MapBatches(Reward)->MapBatches(GRPOAdvantage))", "reward/advantage/log actors"),
        ("ray::TorchTrainer.train_step", "trainer"),
        ("ray::VersionClock.acquire", "control actors and tasks"),
        ("/v/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --flags", "Ray daemons"),
        ("kworker/1:1", "other"),
    ],
)
def test_each_process_of_a_run_has_its_kind(cmdline, kind):
    assert kind_of(cmdline) == kind


def test_cores_are_cpu_seconds_over_the_window_and_samples_outside_it_are_left_out():
    samples = [(10.0, {"trainer": 5.0}), (11.0, {"trainer": 0.5, "gate actor": 0.25}), (12.0, {"trainer": 0.5})]
    samples += [(13.0, {"trainer": 0.9, "gate actor": 0.1}), (14.0, {"trainer": 9.0})]
    assert cores_between(samples, 11.0, 13.5) == pytest.approx({"trainer": 1.9 / 2.5, "gate actor": 0.35 / 2.5})
    with pytest.raises(ValueError, match="fewer than two CPU samples"):
        cores_between(samples, 20.0, 30.0)


def test_the_sampler_counts_a_busy_child_as_its_kind_and_the_driver_as_itself():
    # The child spins until it has used 1.5 s of CPU, however long a loaded machine makes that take; the sampler
    # loses at most its last period (0.25 s of wall, so at most 0.25 s of the child's CPU) when the child ends.
    busy = "import time\nwhile time.process_time() < 1.5: pass"
    sampler = Sampler(period_s=0.25)
    sampler.start()
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        child.wait(120)
    finally:
        child.kill()
    sampler.stopped.set()
    sampler.join(5)
    cpu_s = collections.Counter()
    for _, used in sampler.samples:
        cpu_s.update(used)
    assert 1.5 - 0.25 - 0.1 < cpu_s["other"] < 1.5 + 0.1, cpu_s  # the child's, whatever its share of the cores
    assert cpu_s[DRIVER] < cpu_s["other"]
    assert set(cores_between(sampler.samples, sampler.samples[0][0] - 0.25, sampler.samples[-1][0])) == set(cpu_s)


def test_the_report_measures_between_the_first_step_kept_and_the_step_after_the_last(tmp_path, capsys):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench.cpu_share import report

    (tmp_path / "consumed").mkdir()
    starts = {1: 100.0, 2: 104.0, 3: 106.0, 4: 110.0, 5: 111.0}  # step 5 starts where the window of 2-4 ends
    steps = [s for s in starts for _ in range(2)]
    times = [t + i * 0.5 for t in starts.values() for i in range(2)]
    pq.write_table(pa.table({"consumed_step": steps, "consumed_time": times}), tmp_path / "consumed" / "a.parquet")
    rows = [{"step": s, "timing/train_s": 0.1 * s} for s in starts]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = [(100.0 + t, {"trainer": 0.5, "driver (Ray Data, gate, sink)": 0.25}) for t in range(12)]
    summary = {"run_dir": str(tmp_path), "trainer_idle_ratio": 0.5, "rollouter_idle_ratio": 0.25, "audit_ok": True}
    report(summary, samples, first=2, last=4)
    out = capsys.readouterr().out
    assert "2.33 s per step, of which the trainer's own step 0.30 s" in out  # (111 - 104) / 3; steps 2-4
    assert "trainer                           0.50" in out  # 7 samples at 104..110 of 0.5 s each over 7 s
    assert "audit PASS" in out
