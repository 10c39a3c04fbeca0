"""Reward sources beyond a rule, in the real stream: a discriminative reward model trained here scores in its own
actor stage and the policy learns against it; a generative judge (the policy's starting weights, served by a vLLM
engine of its own) judges every response, and the groups its parser fails on are dropped and refilled through the
gate (the judge's run also trains with verl's optimal token baseline, the trainer subtracting its baseline); a real
HTTP reward service on loopback, started by the test, answers with 500s, timeouts and slow answers, and every sample
is scored or accounted for, retries counted, the audit passing.

The reward model's run is the default job (staleness 0.5, no partial rollout) with CISPO's policy loss: it also
carries the checks of verl's async mode with stale samples (tests/pipeline/modes.py) and serial validation (verl's
parallel_validate_and_rollout=false: no training request starts on a replica while it validates). Validation
interleaved with the stream is checked in test_learning.py's run, on a dedicated engine beside a pulling stream in
test_pull.py's.
"""

import json
import os
import zlib
from collections import Counter
from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.config import CONF_DIR
from pipeline.tasks.embedded import build_embedded
from pipeline.tasks.embedded_rm import build_reward_model
from pipeline.tasks.warmstart import cached_warm_start
from stages.user_code import load_user_module
from stages.verifiers import score_reverse
from tests.pipeline.modes import check_mode
from tests.reward_server import Answer, RewardServer

RM_STEPS = 800  # the reward model's training steps (pipeline/tasks/embedded_rm.py: 0.87 held-out pair agreement)


def samples(run_dir: Path, columns: list[str]) -> list[dict]:
    return pads.dataset(run_dir / "samples").to_table(columns=columns).to_pylist()


def consumed_ids(run_dir: Path) -> set[str]:
    return set(pads.dataset(run_dir / "consumed").to_table(columns=["sample_id"])["sample_id"].to_pylist())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tenths(values: list[float]) -> tuple[float, float]:
    tenth = max(1, len(values) // 10)
    return sum(values[:tenth]) / tenth, sum(values[-tenth:]) / tenth


@pytest.fixture(scope="module")
def starting_policy(tmp_path_factory) -> Path:
    """The embedded policy warm-started as a run warm-starts it (the session's cache: the runs below load it)."""
    root = tmp_path_factory.mktemp("policy")
    task = build_embedded(root, 2000, seed=0)
    cache = f"{os.environ['ASYNCRL_CACHE_DIR']}/warm_start"
    cached_warm_start(task.model_dir, task.data_file, 500, 2e-3, 0, 0.5, cache)
    return task.model_dir


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, starting_policy):
    """A reward model trained from the starting policy to predict the task's rule score."""
    out = tmp_path_factory.mktemp("rm")
    fit = build_reward_model(out, starting_policy, steps=RM_STEPS, threads=2)  # the fit has the machine to itself
    assert fit["pair_agreement"] > 0.8, fit  # it orders two answers to one prompt as the rule does
    return out


@pytest.mark.slow
def test_the_policy_learns_against_a_reward_model_in_the_stream(run_job, reward_model):
    summary, run_dir = run_job(
        # 50 steps of 8 prompts: the policy's rule score rises through them; over 100 it can over-optimise the
        # reward model (a CI run: the rule score 0.17 -> 0.55 by step 40, then down to 0.20 at step 100 while the
        # model's score still rose), as any learned reward lets a policy do
        "rollout.total_rollout_steps=400",
        "reward.reward_model.enable=true",
        f"reward.reward_model.model_path={reward_model}",
        "reward.reward_model.micro_batch_size_per_gpu=16",
        "actor.policy_loss.loss_mode=cispo",  # CISPO's clipped, stop-gradient IS weight: it learns too
        "trainer.monitor=jsonl",
        *SERIAL_VALIDATION,
        name="reward-model",
    )
    assert summary["audit_ok"] and summary["steps"] == 50
    check_mode(summary, run_dir, s=0.5, k=1, prompts=400, per_step=8, n=8)
    assert_serial_validation(run_dir, (0, 25, 50))
    rows = samples(run_dir, ["sample_id", "response_text", "ground_truth", "reward", "reward_sources", "reward_status"])
    # the reward model scored every sample, and its score is the reward (verl: a reward model replaces the rule)
    for row in rows:
        (name, rec), *others = row["reward_sources"]
        assert name == "reward_model" and not others and rec["error"] is None and rec["latency_s"] > 0
        assert row["reward"] == pytest.approx(rec["score"]) and row["reward_status"] == "ok"
    steps = metrics(run_dir)
    assert all(m["reward/reward_model/share"] == 1.0 and m["reward/reward_model/error_ratio"] == 0 for m in steps)
    # the policy learns against it: the reward model's score rises, and so does the task's own rule score, which
    # nothing in the run computed (the reward model only learned to predict it)
    rm_first, rm_last = tenths([m["reward/mean"] for m in steps])
    assert rm_last > rm_first + 0.1, (rm_first, rm_last)
    trained = consumed_ids(run_dir)
    by_step = pads.dataset(run_dir / "consumed").to_table(columns=["sample_id", "consumed_step"]).to_pylist()
    step_of = {r["sample_id"]: r["consumed_step"] for r in by_step}
    rule: dict[int, list[float]] = {}
    for row in rows:
        if row["sample_id"] in trained:
            rule.setdefault(step_of[row["sample_id"]], []).append(
                score_reverse(row["response_text"], row["ground_truth"])
            )
    curve = [sum(v) / len(v) for _, v in sorted(rule.items())]
    first, last = tenths(curve)
    assert last > first + 0.15, f"rule score {first:.3f} -> {last:.3f}, curve {[round(c, 2) for c in curve[::10]]}"


# 16 held-out prompts, 2 samples each, before the first step and every 25 versions; the replica validates alone.
SERIAL_VALIDATION = [
    "data.val_files=embedded",
    "data.num_embedded_val_prompts=16",
    "rollout.test_freq=25",
    "trainer.val_before_train=true",
    "rollout.val_kwargs.n=2",
    "async_training.parallel_validate_and_rollout=false",
]


def assert_serial_validation(run_dir: Path, versions: tuple[int, int, int]) -> None:
    """No training request started while a validation pass ran, and the stream generated on both sides of the
    middle pass."""
    training = pq.read_table(run_dir / "samples", columns=["generated_time", "gen_latency_s"]).to_pylist()
    starts = [r["generated_time"] - r["gen_latency_s"] for r in training]
    windows = {}
    for version in versions:
        table = pq.read_table(run_dir / "validation" / f"version-{version:06d}.parquet").to_pylist()
        windows[version] = min(r["started_time"] for r in table), max(r["generated_time"] for r in table)
        begin, end = windows[version]
        inside = [s for s in starts if begin + 0.05 < s < end - 0.05]
        assert not inside, (version, begin, end, inside[:3])
    begin, end = windows[versions[1]]
    assert min(starts) < begin and max(starts) > end


# The judge answers the task itself; its answer is the reference the response is scored against, and its parser
# fails on about one response in forty (a group holding one is dropped, then refilled).
JUDGE_FILE = """
import zlib

from stages.user_code import load_user_module
from stages.verifiers import score_reverse


def judge_prompt(prompt, response, ground_truth, data_source):
    return prompt


def judge_score(verdict, prompt, response, ground_truth, data_source):
    if zlib.crc32((prompt + response).encode()) % 40 == 0:
        raise ValueError("no verdict found")
    return score_reverse(response, verdict)
"""


@pytest.mark.slow
def test_a_judge_scores_in_the_stream_and_groups_it_fails_on_are_refilled(run_job, starting_policy, tmp_path):
    (tmp_path / "judge.py").write_text(JUDGE_FILE)
    summary, run_dir = run_job(
        "rollout.total_rollout_steps=96",
        "reward.judge.enable=true",
        f"reward.judge.path={tmp_path / 'judge.py'}",
        "reward.judge.max_tokens=32",
        "reward.judge.max_model_len=128",
        "reward.on_error=drop_group",
        "algorithm.adv_estimator=optimal_token_baseline",  # verl's OTB: the trainer subtracts its baseline
        "algorithm.rollout_correction.bypass_mode=false",  # from its proximal pass, as verl's needs
        "actor.calculate_sum_pi_squared=true",
        "rollout.prompts_per_call=1",  # a dropped group's replacement comes through the gate one prompt at a time
        "rollout.calls_in_flight=8",
        "trainer.monitor=jsonl",
        name="judge",
    )
    assert summary["audit_ok"], (run_dir / "audit.txt").read_text()
    rows = samples(
        run_dir,
        [
            "sample_id",
            "prompt_id",
            "prompt_text",
            "response_text",
            "reward",
            "reward_sources",
            "reward_status",
            "reward_error",
            "token_advantages",
        ],
    )
    judge = load_user_module(str(tmp_path / "judge.py"), "test")
    verdicts: dict[str, set[str]] = {}
    for row in rows:
        (name, rec), *others = row["reward_sources"]
        assert name == "judge" and not others and rec["output"] is not None and rec["latency_s"] > 0
        verdicts.setdefault(row["prompt_text"], set()).add(rec["output"])
        try:  # the score is the user's parser's reading of the verdict on record
            expected, error = judge.judge_score(rec["output"], row["prompt_text"], row["response_text"], "", ""), None
        except ValueError as err:
            expected, error = None, str(err)
        if error:
            assert rec["score"] is None and "judge_score raised ValueError: no verdict found" in rec["error"]
            assert row["reward_status"] == "dropped" and row["reward_error"].startswith("judge: ")
        else:
            assert rec["error"] is None and rec["score"] == pytest.approx(expected)
            # the stream's half of the optimal token baseline: the returns, the reward on every token (none for a
            # member of a dropped group: it is out of the loss)
            returns = row["reward"] if row["reward_status"] == "ok" else 0.0
            assert row["token_advantages"] == pytest.approx([returns] * len(row["token_advantages"]))
    # greedy and frozen: one verdict per judge prompt, the starting weights' own greedy answer (computed here with
    # transformers, which may break a near-tie the other way on a token: 90 % of the prompts, not all)
    assert all(len(v) == 1 for v in verdicts.values())
    agree = [
        next(iter(v)) == greedy
        for v, greedy in zip(verdicts.values(), hf_greedy(starting_policy, verdicts), strict=True)
    ]
    assert sum(agree) >= 0.9 * len(agree), f"{sum(agree)} of {len(agree)} verdicts are the starting policy's"
    # every dropped group left out whole and refilled: full steps, none of it trained
    left_out = pq.read_table(run_dir / "filtered").to_pylist()
    dropped = {r["prompt_id"] for r in rows if r["reward_status"] == "dropped"}
    assert dropped and {r["prompt_id"] for r in left_out} == dropped and summary["groups_dropped"] == len(dropped)
    assert {r["filtered_reason"] for r in left_out} == {"reward_failed"}
    assert not dropped & {r["prompt_id"] for r in pads.dataset(run_dir / "consumed").to_table().to_pylist()}
    consumed = pads.dataset(run_dir / "consumed").to_table(columns=["prompt_id", "consumed_step"]).to_pylist()
    per_step = Counter(step for _, step in {(r["prompt_id"], r["consumed_step"]) for r in consumed})
    assert set(per_step.values()) == {8} and summary["steps"] == len(per_step) >= 8
    refilled = sum(m.get("reward/dropped_groups_refilled", 0) for m in metrics(run_dir))
    after_last = sum(
        1 for pid in dropped if next(r for r in left_out if r["prompt_id"] == pid)["filtered_step"] > summary["steps"]
    )
    assert refilled + after_last == len(dropped)
    assert "dropped for a failed reward and refilled" in (run_dir / "audit.txt").read_text()


def hf_greedy(model_dir: Path, prompts) -> list[str]:
    """The model's greedy answer to each prompt, with transformers, as the judge's engine reads and decodes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with torch.inference_mode():
            tokens = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
        out.append(tokenizer.decode(tokens, skip_special_tokens=True))
    return out


def faults(payload: dict, nth: int) -> Answer:
    """The service scores with the task's rule; a sample's id decides its fault: a 500 on its first request, a first
    request that outlives the client's timeout, slow answers within it, or 503 on every request."""
    score = json.dumps({"score": score_reverse(payload["solution_str"], payload["ground_truth"])})
    kind = zlib.crc32(payload["sample_id"].encode()) % 10
    if kind == 0 and nth == 1:
        return Answer("internal error", status=500)
    if kind == 1 and nth == 1:
        return Answer(score, delay_s=2.5)
    if kind == 2:
        return Answer(score, delay_s=0.3)
    if kind == 3:
        return Answer("overloaded", status=503)
    return Answer(score)


@pytest.mark.slow
def test_a_remote_service_with_faults_scores_every_sample_or_accounts_for_it(run_job):
    """In verl's async mode with partial rollout, `keep` pause mode: the mode's checks (tests/pipeline/modes.py) run on
    the same logs."""
    with RewardServer(faults) as server:
        summary, run_dir = run_job(
            "rollout.total_rollout_steps=64",  # 8 steps of 8 prompts
            "async_training.partial_rollout_mode=keep",
            f"reward.remote.url={server.url}",
            "reward.remote.timeout_s=1.0",
            "reward.remote.max_retries=2",
            "reward.remote.backoff_s=0.05",
            "trainer.monitor=jsonl",
            config=str(CONF_DIR / "async_partial.yaml"),
            name="remote",
        )
    assert summary["audit_ok"] and summary["steps"] == 8
    check_mode(summary, run_dir, s=0.5, k=1, prompts=64, per_step=8, n=8)
    audit = (run_dir / "audit.txt").read_text()
    assert "every failed reward accounted for" in audit
    rows = samples(run_dir, ["sample_id", "reward", "reward_error", "reward_sources", "reward_status", "response_mask"])
    kinds = {r["sample_id"]: zlib.crc32(r["sample_id"].encode()) % 10 for r in rows}
    # every generated sample went to the service, and the attempts it counted are the requests the service received
    attempts = {r["sample_id"]: dict(r["reward_sources"])["remote"]["attempts"] for r in rows}
    assert attempts == dict(server.requests)
    for row in rows:
        rec, kind = dict(row["reward_sources"])["remote"], kinds[row["sample_id"]]
        if kind == 3:  # failed for good: three attempts, masked, out of the loss, its error on record
            assert rec["attempts"] == 3 and "HTTP 503" in rec["error"] and row["reward_error"].startswith("remote: ")
            assert row["reward_status"] == "masked" and not any(row["response_mask"]) and row["reward"] == 0.0
        else:  # a 500 or a timeout retried once; the rest scored first time
            assert rec["error"] is None and row["reward_status"] == "ok"
            assert rec["attempts"] == (2 if kind in (0, 1) else 1)
            assert row["reward"] == pytest.approx(rec["score"])
        if kind == 1:
            assert rec["latency_s"] >= 1.0  # the cut attempt's wait is in the sample's latency
    assert {0, 1, 2, 3} <= set(kinds.values())  # every fault was met
    # the step metrics count the retries of exactly the trained samples
    trained = consumed_ids(run_dir)
    retried = sum(attempts[s] - 1 for s in trained)
    assert sum(m["reward/remote/retries"] for m in metrics(run_dir)) == retried
    masked = sum(1 for r in rows if r["sample_id"] in trained and r["reward_status"] == "masked")
    assert sum(m["reward/status/masked_ratio"] * 64 for m in metrics(run_dir)) == pytest.approx(masked)
