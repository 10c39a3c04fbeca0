"""DAPO's dynamic sampling and the refill of groups reward.on_error=drop_group drops: the group decision
(stages/group_filter.py), the clock's refund of a filtered prompt's permit (pipeline/clock.py), the sink leaving
filtered and dropped groups out and logging them (stages/sink.py), and the audit's rule on the filter log
(pipeline/observe/audit_filter.py)."""

import asyncio
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from pipeline.clock import VersionClock
from pipeline.observe.audit_filter import filtered_groups
from schemas import FILTERED_SCHEMA
from stages.group_filter import GroupFilter, MissingMetricError
from stages.sink import DynamicSampling, FilterCapError, TrainingSink
from stages.staleness import StalenessBudget
from tests.unit.test_clock import settle
from tests.unit.test_sink import N, group, ids


def scored(pid: str, rewards: list[float], extra: list[dict] | None = None, version: int = 0) -> pa.Table:
    table = group(pid, version)
    table = table.set_column(table.schema.get_field_index("reward"), "reward", pa.array(rewards, pa.float64()))
    infos = [json.dumps(e) for e in extra] if extra else [None] * N
    return table.set_column(table.schema.get_field_index("reward_extra_info"), "reward_extra_info", pa.array(infos))


def test_a_group_whose_metric_does_not_vary_is_filtered_at_its_value():
    assert GroupFilter("seq_reward").shared_value(scored("a", [1.0, 1.0])) == 1.0
    assert GroupFilter("seq_final_reward").shared_value(scored("a", [0.0, 0.0])) == 0.0
    assert GroupFilter("reward").shared_value(scored("a", [0.5, 0.5000001])) is None  # exactly equal only (verl)
    acc = GroupFilter("acc")
    assert acc.shared_value(scored("a", [0.2, 0.7], [{"acc": 0}, {"acc": 0}])) == 0.0  # on acc, not on reward
    assert acc.shared_value(scored("a", [0.2, 0.2], [{"acc": 0}, {"acc": 1}])) is None
    one = scored("a", [1.0, 1.0], [{"acc": 1}, {"acc": 1}]).slice(0, 1)
    assert acc.shared_value(one) is None  # one response: no variance to speak of


def test_a_missing_metric_names_it_and_a_failed_reward_is_left_to_its_policy():
    with pytest.raises(MissingMetricError, match=r"metric='acc' is not in .* group a \(its keys: \['score'\]\)"):
        GroupFilter("acc").shared_value(scored("a", [1.0, 1.0], [{"score": 1}, {"score": 1}]))
    masked = scored("a", [0.0, 0.0])
    i = masked.schema.get_field_index("reward_status")
    masked = masked.set_column(i, "reward_status", pa.array(["ok", "masked"]))
    assert GroupFilter("seq_reward").shared_value(masked) is None


def test_a_filtered_prompt_frees_its_permit_and_nothing_else_does():
    async def scenario():
        clock = VersionClock(StalenessBudget(0.0, 1, 1, 2), num_replicas=1)  # B = 2 per version
        assert await clock.acquire(["p0", "p1", "p2"]) == (0, ["p0", "p1"])
        waiter = asyncio.create_task(clock.acquire(["p2", "p3"]))
        await settle()
        assert not waiter.done()
        assert await clock.filtered(["p0"]) == 0  # done, and its permit admits a prompt in its place
        assert await asyncio.wait_for(waiter, 1) == (0, ["p2"])
        await clock.consumed(["p1"])  # consumption frees nothing until the sync (verl's counter)
        late = asyncio.create_task(clock.acquire(["p3"]))
        await settle()
        assert not late.done()
        stats = await clock.stats()
        assert stats["outstanding"] == 1 and stats["filtered_total"] == 1
        assert [p for p, _, _ in await clock.admissions(consumed_only=True)] == ["p0", "p1"]  # a checkpoint's
        with pytest.raises(ValueError, match="p0 filtered but not outstanding"):
            await clock.filtered(["p0"])
        late.cancel()

    asyncio.run(scenario())


def sampling_sink(blocks, tmp_path, cap: int = 0):
    told: list[str] = []
    sampling = DynamicSampling(GroupFilter("seq_reward"), lambda p: told.extend(p) or 3, str(tmp_path / "f"), cap)
    sink = TrainingSink(
        iter(blocks), StalenessBudget(0.5, 1, 1, 2), N, str(tmp_path / "c"), lambda v: 0, None, sampling
    )
    return sink, told


def test_the_sink_trains_full_steps_of_groups_with_signal_and_logs_the_rest(tmp_path):
    blocks = [scored("a", [1, 1]), scored("b", [0, 1]), scored("c", [0, 0]), scored("d", [1, 0]), scored("e", [1, 1])]
    sink, told = sampling_sink(blocks, tmp_path)
    step = sink.next_step(version=0, steps_left_after_this=0)
    assert ids(step) == ["b", "d"] and step.filtered_groups == 2 and told == ["a", "c"]
    sink.record(step, 0, 1)
    assert sink.next_step(version=1, steps_left_after_this=0) is None  # e filtered, then the stream ended
    sink.finish()
    log = pq.read_table(tmp_path / "f").to_pylist()
    assert [(r["prompt_id"], r["filtered_step"], r["filtered_value"], r["filtered_version"]) for r in log] == [
        (p, s, v, 3)
        for p, s, v in [("a", 1, 1.0), ("a", 1, 1.0), ("c", 1, 0.0), ("c", 1, 0.0), ("e", 2, 1.0), ("e", 2, 1.0)]
    ]


def test_more_filtered_groups_than_the_cap_for_one_step_stop_the_run(tmp_path):
    sink, _ = sampling_sink([scored(p, [1, 1]) for p in "abc"], tmp_path, cap=2)
    with pytest.raises(FilterCapError, match="filtered 3 groups while one step filled.*max_num_gen_batches"):
        sink.next_step(version=0, steps_left_after_this=0)


def test_the_audit_fails_a_filter_log_that_lies(tmp_path):
    cfg = OmegaConf.create(
        {"algorithm": {"filter_groups": {"enable": True, "metric": "seq_reward"}}, "rollout": {"n": N}}
    )
    samples = pa.concat_tables([scored("a", [1, 1]), scored("b", [0, 1]), scored("c", [0, 0])])
    consumed = pa.table({"sample_id": ["b/0", "b/1"], "prompt_id": ["b", "b"]})

    def log(rows):
        return pa.Table.from_pylist(
            [
                {
                    "sample_id": s,
                    "prompt_id": s[0],
                    "filtered_version": 0,
                    "filtered_step": 1,
                    "filtered_value": v,
                    "filtered_reason": "flat",
                }
                for s, v in rows
            ],
            schema=FILTERED_SCHEMA,
        )

    honest = log([("a/0", 1.0), ("a/1", 1.0)])  # c neither filtered nor trained: in flight at the end
    assert filtered_groups(honest, consumed, samples, cfg).ok
    assert filtered_groups(log([("a/0", 1.0), ("a/1", 1.0), ("c/0", 0.0), ("c/1", 0.0)]), consumed, samples, cfg).ok
    trained_c = pa.table({"sample_id": ["b/0", "b/1", "c/0", "c/1"], "prompt_id": ["b", "b", "c", "c"]})
    for bad, why in [
        (log([("a/0", 1.0)]), "not its whole group"),
        (log([("b/0", 0.0), ("b/1", 0.0)]), "left out and trained"),
        (log([("a/0", 0.0), ("a/1", 0.0), ("c/0", 0.0), ("c/1", 0.0)]), "filtered at 0.0"),
    ]:
        check = filtered_groups(bad, consumed, samples, cfg)
        assert not check.ok and why in check.detail, check.detail
    check = filtered_groups(honest, trained_c, samples, cfg)
    assert not check.ok and "c (trained, its seq_reward the same" in check.detail


def failed(pid: str, rewards: list[float]) -> pa.Table:
    """A group the reward step dropped (reward.on_error=drop_group): every member 'dropped'."""
    table = scored(pid, rewards)
    i = table.schema.get_field_index("reward_status")
    return table.set_column(i, "reward_status", pa.array(["dropped"] * N))


def test_the_sink_refills_dropped_groups_and_logs_them_with_their_reason(tmp_path):
    told: list[str] = []
    refill = DynamicSampling(None, lambda p: told.extend(p) or 5, str(tmp_path / "f"), drop_failed=True)
    blocks = [failed("a", [0, 1]), scored("b", [1, 1]), failed("c", [0, 0]), scored("d", [0, 1])]
    sink = TrainingSink(iter(blocks), StalenessBudget(0.5, 1, 1, 2), N, str(tmp_path / "c"), lambda v: 0, None, refill)
    step = sink.next_step(version=0, steps_left_after_this=0)
    # a flat group trains without a filter; the dropped ones are out, the clock told so that it admits others
    assert ids(step) == ["b", "d"] and told == ["a", "c"]
    assert step.dropped_groups == 2 and step.filtered_groups is None
    sink.record(step, 0, 1)
    log = pq.read_table(tmp_path / "f").to_pylist()
    assert {(r["prompt_id"], r["filtered_reason"], r["filtered_value"], r["filtered_step"]) for r in log} == {
        ("a", "reward_failed", None, 1),
        ("c", "reward_failed", None, 1),
    }


def test_the_audit_fails_a_dropped_group_that_was_trained_or_never_failed():
    cfg = OmegaConf.create({"algorithm": {}, "rollout": {"n": N}, "reward": {"on_error": "drop_group"}})
    samples = pa.concat_tables([failed("a", [0, 1]), scored("b", [0, 1]), scored("c", [1, 0])])
    consumed = pa.table({"sample_id": ["b/0", "b/1"], "prompt_id": ["b", "b"]})

    def log(rows, reason="reward_failed"):
        return pa.Table.from_pylist(
            [
                {
                    "sample_id": s,
                    "prompt_id": s[0],
                    "filtered_version": 0,
                    "filtered_step": 1,
                    "filtered_value": None,
                    "filtered_reason": reason,
                }
                for s in rows
            ],
            schema=FILTERED_SCHEMA,
        )

    honest = log(["a/0", "a/1"])
    check = filtered_groups(honest, consumed, samples, cfg)
    assert check.ok and "1 dropped for a failed reward and refilled" in check.detail, check.detail
    trained_a = pa.table({"sample_id": ["b/0", "b/1", "a/0", "a/1"], "prompt_id": ["b", "b", "a", "a"]})
    not_drop = OmegaConf.create({"algorithm": {}, "rollout": {"n": N}, "reward": {"on_error": "mask"}})
    for filter_log, trained, run_cfg, why in [
        (None, trained_a, cfg, "a (trained, a group the reward step dropped"),
        (log(["c/0", "c/1"]), consumed, cfg, "c (dropped for a failed reward, its samples' statuses"),
        (honest, consumed, not_drop, "whose reward.on_error is not drop_group"),
        (log(["a/0", "a/1"], reason="flat"), consumed, cfg, "by a run whose algorithm.filter_groups is off"),
    ]:
        check = filtered_groups(filter_log, trained, samples, run_cfg)
        assert not check.ok and why in check.detail, check.detail


def test_dynamic_sampling_needs_its_metric_and_one_prompt_per_call():
    from pipeline.config import ConfigError, load_config

    on = ["algorithm.filter_groups.enable=true", "rollout.prompts_per_call=1"]
    with pytest.raises(ConfigError, match="needs algorithm.filter_groups.metric"):
        load_config(None, on)
    with pytest.raises(ConfigError, match="set rollout.prompts_per_call=1"):
        load_config(None, [*on[:1], "algorithm.filter_groups.metric=acc", "rollout.prompts_per_call=2"])
    with pytest.raises(ConfigError, match="drop_group refills a dropped group's place.*prompts_per_call=1"):
        load_config(None, ["reward.on_error=drop_group", "rollout.prompts_per_call=2"])
    cfg = load_config(
        None, [*on, "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=3"]
    )
    assert (cfg.algorithm.filter_groups.metric, cfg.algorithm.filter_groups.max_num_gen_batches) == ("acc", 3)
