"""The remote reward service's client (stages/remote_reward.py) against a real HTTP server on loopback
(tests/reward_server.py) that injects 500s, timeouts, slow and malformed answers: every sample is scored or carries
its error, and the attempts the client counts are the requests the server received."""

import socket

import pyarrow as pa
import pytest

from stages.remote_reward import RemoteReward, check_reachable, parse_score
from stages.reward_sources import RewardSources, records_of
from tests.reward_server import Answer, RewardServer


def block(names: list[str]) -> pa.Table:
    n = len(names)
    return pa.table(
        {
            "prompt_id": ["p"] * n,
            "sample_id": names,
            "prompt_text": ["reverse: a b ="] * n,
            "response_text": ["b a"] * n,
            "ground_truth": ["b a"] * n,
            "data_source": ["reverse"] * n,
        }
    )


def faults(payload: dict, nth: int) -> Answer:
    """Each sample id names how the service treats it."""
    name = payload["sample_id"]
    if name == "ok":
        return Answer('{"score": 0.7, "why": "fine"}')
    if name == "two_500s":
        return Answer("oops", status=500) if nth <= 2 else Answer("1")
    if name == "slow":
        return Answer("0.25", delay_s=0.3)  # under the timeout: one attempt
    if name == "hangs_once":
        return Answer("0.5", delay_s=3.0) if nth == 1 else Answer("0.5")
    if name == "garbage":
        return Answer("<html>not json</html>")
    if name == "not_a_score":
        return Answer('{"verdict": "yes"}')
    if name == "bad_request":
        return Answer('{"error": "no such data source"}', status=400)
    if name == "always_503":
        return Answer("busy", status=503)
    raise AssertionError(name)


NAMES = ["ok", "two_500s", "slow", "hangs_once", "garbage", "not_a_score", "bad_request", "always_503"]


def test_every_sample_is_scored_or_carries_its_error_and_retries_are_counted():
    with RewardServer(faults) as server:
        stage = RemoteReward(server.url, max_concurrent=4, timeout_s=1.0, max_retries=3, backoff_s=0.01)
        out = records_of(stage(block(NAMES)))
    recs = {name: r["remote"] for name, r in zip(NAMES, out, strict=True)}
    assert recs["ok"]["score"] == pytest.approx(0.7) and recs["ok"]["error"] is None
    assert recs["two_500s"]["score"] == 1.0 and recs["two_500s"]["attempts"] == 3
    assert recs["slow"]["score"] == 0.25 and recs["slow"]["attempts"] == 1 and recs["slow"]["latency_s"] >= 0.3
    assert recs["hangs_once"]["score"] == 0.5 and recs["hangs_once"]["attempts"] == 2
    assert recs["hangs_once"]["latency_s"] >= 1.0  # the cut attempt's second counts
    for name, why in [("garbage", "not JSON"), ("not_a_score", "not a finite number"), ("bad_request", "HTTP 400")]:
        assert recs[name]["score"] is None and why in recs[name]["error"], recs[name]
        assert recs[name]["attempts"] == 1  # asking again would get the same
    assert recs["always_503"]["attempts"] == 4 and "HTTP 503" in recs["always_503"]["error"]
    # the client's count of attempts is the server's count of requests, sample by sample
    assert {n: r["attempts"] for n, r in recs.items()} == dict(server.requests)
    assert server.answered[500] == 2 and server.answered[503] == 4


def test_requests_run_concurrently_up_to_max_concurrent():
    names = [f"s{i}" for i in range(12)]
    with RewardServer(lambda payload, nth: Answer("1", delay_s=0.2)) as server:
        out = records_of(RemoteReward(server.url, max_concurrent=3)(block(names)))
    assert [r["remote"]["score"] for r in out] == [1.0] * 12
    assert server.max_in_flight == 3


def test_the_failure_policy_applies_to_what_the_service_failed():
    with RewardServer(faults) as server:
        remote = RemoteReward(server.url, timeout_s=1.0, max_retries=0, backoff_s=0.0)
        out = RewardSources(remote=remote, on_error="retry", max_attempts=3, backoff_s=0.0)(
            block(["ok", "two_500s", "garbage"])
        )
    # with no retries of its own, the service's two 500s are outlived by the policy's third call
    assert out["reward"].to_pylist() == pytest.approx([0.7, 1.0, 0.0])
    assert out["reward_status"].to_pylist() == ["ok", "ok", "masked"]
    assert [r["remote"]["attempts"] for r in records_of(out)] == [1, 3, 3]
    assert out["reward_error"].to_pylist()[2].startswith("remote: the service answered")


def test_an_unreachable_or_wrong_url_is_one_clear_error_and_a_live_one_none():
    with socket.socket() as s:  # a port nothing listens on: held, never listened on, while it is probed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        message = check_reachable(f"http://127.0.0.1:{port}/score", timeout_s=5)
    assert message.startswith(f"reward.remote.url http://127.0.0.1:{port}/score cannot be reached")
    assert "Start the service, or fix the URL" in message
    with RewardServer(faults) as server:
        assert check_reachable(server.url) is None  # POST-only: a GET gets 405, which is an answer
        assert "404 Not Found" in check_reachable(server.url.replace("/score", "/nowhere"))


@pytest.mark.parametrize(
    "text, score", [("0.5", 0.5), ('{"score": 2}', 2.0), ("true", None), ("NaN", None), ('{"score": "1"}', None)]
)
def test_parse_score(text, score):
    value, error = parse_score(text)
    assert value == score and (error is None) == (score is not None)
