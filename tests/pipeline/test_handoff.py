"""The hand-off on a real Ray: a dataset's blocks reach the sink without their per-token columns, and the trainer side
gets back exactly the rows the stream produced, joined by sample_id, with the step transform over the whole step;
also when Ray Data cuts a split block into several (each row its own block)."""

import asyncio
import itertools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from schemas import PER_TOKEN_COLUMNS, SAMPLE_SCHEMA, TOKEN_TABLE_COLUMNS
from stages.advantage import whiten_step
from stages.handoff import ByReference, SplitTokens, StepRows, TokenTables
from stages.sink import TrainingSink
from stages.staleness import StalenessBudget

N = 2  # responses per prompt


def _group(pid: str, version: int, rng) -> pa.Table:
    lengths = rng.integers(50, 400, N)
    cols = {name: [None] * N for name in SAMPLE_SCHEMA.names}
    cols |= {
        "prompt_id": [pid] * N,
        "sample_id": [f"{pid}/{i}" for i in range(N)],
        "prompt_ids": [[1, 2, 3]] * N,
        "prompt_text": ["1+1?"] * N,
        "response_ids": [rng.integers(5, 90, n).tolist() for n in lengths],
        "response_text": ["x" * int(n) for n in lengths],
        "response_logprobs": [(-rng.random(n)).tolist() for n in lengths],
        "token_param_version": [[version] * int(n) for n in lengths],
        "response_mask": [[1] * int(n) for n in lengths],
        "token_advantages": [rng.normal(size=n).tolist() for n in lengths],
        "advantage": rng.normal(size=N).tolist(),
        "admitted_version": [version] * N,
        "admitted_time": [float(version)] * N,
        "param_version": [version] * N,
        "param_version_end": [version] * N,
        "num_tokens": lengths.tolist(),
        "num_resumes": [0] * N,
        "reward": [1.0, 0.0],
        "finish_reason": ["stop"] * N,
    }
    return pa.table(cols, schema=SAMPLE_SCHEMA)


def _split(ray, blocks: list[pa.Table], tables):
    """The blocks through the stream's last stage, and the actor that keeps that stream open until it is set.

    A run's stream stays open until its trainer is done (the gate holds its end marker), and with it the split
    actors, which own the per-token tables. A finite dataset would end at once and take them down before the
    tables are fetched: an empty block that comes only once released keeps it open the same way."""

    class Release:  # defined here, so that Ray ships it by value: the workers do not import the tests
        def __init__(self) -> None:
            self.event = asyncio.Event()

        async def wait(self) -> None:
            await self.event.wait()

        async def set(self) -> None:
            self.event.set()

    release = ray.remote(num_cpus=0)(Release).remote()
    empty = blocks[0].slice(0, 0)

    def held(_):
        ray.get(release.wait.remote())
        return empty

    stream = ray.data.from_arrow(blocks).union(
        ray.data.from_items([{"held": 1}]).map_batches(held, batch_format="pyarrow", num_cpus=0)
    )
    split = stream.map_batches(
        SplitTokens,
        fn_constructor_kwargs={"tables": tables},
        batch_size=None,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=1),
    )
    return split, release


def test_the_driver_gets_the_light_columns_and_the_trainer_the_same_rows(ray_session, tmp_path):
    ray = ray_session
    rng = np.random.default_rng(0)
    blocks = [pa.concat_tables([_group(f"p{b}{g}", b, rng) for g in range(2)]) for b in range(3)]
    tables = TokenTables.start()
    budget = StalenessBudget(0.0, 1, 1, 4)  # a step of 4 prompts, from blocks of 2
    stream, release = _split(ray, blocks, tables)
    sink = TrainingSink(
        ByReference(stream, tables),
        budget,
        N,
        str(tmp_path / "consumed"),
        lambda v: 0,
        whiten_step,
    )
    step = sink.next_step(version=0, steps_left_after_this=0)
    assert not set(PER_TOKEN_COLUMNS) & set(step.table.column_names)  # nothing per token crossed the driver
    assert step.heavy_bytes > 5 * step.driver_bytes

    minibatches = step.minibatches(2)
    assert isinstance(minibatches, StepRows) and all(minibatches.refs)

    @ray.remote(num_cpus=0)
    def trainer_side(rows: StepRows) -> list[dict]:
        return rows.resolve()

    got = ray.get(trainer_side.remote(minibatches))
    ray.get(release.set.remote())
    sink.close()  # after the fetch: closing the stream ends the split actors, which own the tables
    chosen = [sid for t in minibatches.minibatches for sid in t["sample_id"].to_pylist()]
    everything = pa.concat_tables(blocks)
    original = whiten_step(everything.filter(pc.is_in(everything["sample_id"], pa.array(chosen))))
    by_id = {row["sample_id"]: row for row in original.to_pylist()}
    for mb in got:
        assert set(mb) == set(SAMPLE_SCHEMA.names) | {"trainer_version"}
        for i, sid in enumerate(mb["sample_id"]):
            for name in ("response_ids", "response_logprobs", "token_param_version", "response_text", "reward"):
                assert mb[name][i] == pytest.approx(by_id[sid][name]), (sid, name)
            # whitened over the whole step's tokens, not the mini-batch's
            assert mb["token_advantages"][i] == pytest.approx(by_id[sid]["token_advantages"], abs=1e-5)


def test_a_block_cut_in_rows_is_joined_from_its_one_table(ray_session):
    ray = ray_session
    rng = np.random.default_rng(1)
    blocks = [pa.concat_tables([_group(f"p{b}{g}", b, rng) for g in range(2)]) for b in range(3)]
    tables = TokenTables.start()
    stream, release = _split(ray, blocks, tables)
    reader = ByReference(stream.repartition(target_num_rows_per_block=1), tables)
    delivered = list(itertools.islice(reader, 12))  # every row; the stream is held open
    rows = StepRows([d.light for d in delivered], [[d.ref] for d in delivered]).resolve()
    assert not reader.partial and ray.get(tables.held.remote()) == 0  # nothing left behind once every row came
    ray.get(release.set.remote())
    reader.close()
    assert [d.light.num_rows for d in delivered] == [1] * 12  # Ray Data cut every split block into rows
    assert len({d.ref for d in delivered}) == 3  # one table per split block, taken once
    original = {r["sample_id"]: r for r in pa.concat_tables(blocks).to_pylist()}
    assert sorted(r["sample_id"][0] for r in rows) == sorted(original)
    for mb in rows:
        sid = mb["sample_id"][0]
        assert mb["response_ids"][0] == original[sid]["response_ids"]
        assert mb["token_param_version"][0] == original[sid]["token_param_version"]


def test_a_table_handed_to_its_owner_outlives_the_stage_that_made_it(ray_session):
    """An engine's actor scores and splits its blocks (stages/scored_generate.py), and Ray restarts a dead engine:
    its tables must not die with it. A stage that hands them to TokenTables.own leaves nothing in its own process;
    a block made again under the same name replaces its table instead of leaving a second one behind."""
    ray = ray_session
    rng = np.random.default_rng(2)
    tables = TokenTables.start()
    owners = TokenTables.owners(tables)
    assert list(owners.values()) == [tables]  # one node: the driver's TokenTables owns them itself
    forwarding = ray.remote(TokenTables).options(num_cpus=0).remote(tables)  # as on a node of its own
    stage = ray.remote(SplitTokens).options(num_cpus=0)
    made = {}
    for owner, pid in ((tables, "a"), (forwarding, "b")):
        maker = stage.remote(owner, owned_by_tables=True)
        block = _group(pid, 0, rng)
        made[pid] = (ray.get(maker.__call__.remote(block)), block)
        ray.get(maker.__call__.remote(block))  # the same block again, as after a restart: same name, one table
        ray.kill(maker)  # the process that made the tables is gone
    assert ray.get(tables.held.remote()) == 2
    keys = [light[TOKEN_TABLE_COLUMNS[0]][0].as_py() for light, _ in made.values()]
    refs = [ref[0] for ref in ray.get(tables.take.remote(keys))]
    for (light, block), ref in zip(made.values(), refs, strict=True):
        rows = StepRows([light.drop_columns(list(TOKEN_TABLE_COLUMNS))], [[ref]])
        joined = rows.resolve()[0]
        assert joined["response_ids"] == block["response_ids"].to_pylist()
    for actor in (forwarding, tables):
        ray.kill(actor)  # as ByReference.close does: no TokenTables outlives its stream in the session
