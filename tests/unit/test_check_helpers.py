"""The checks that the stream tests rely on, fed inputs that must fail them: a check that cannot fail proves nothing.

assert_learns (the fault run's learning), check_trajectory (each multi-turn trajectory's tool tokens) and is_loopback
(every listening server) each pass on a good input and fail on each way of breaking it. The audit's rules get the
same treatment on a real run's logs in tests/pipeline/test_audit.py.
"""

import copy

import pytest

from tests.pipeline.test_faults import assert_learns
from tests.pipeline.test_loopback import is_loopback
from tests.pipeline.test_multi_turn import check_trajectory


def test_assert_learns_passes_a_rising_reward_and_fails_a_flat_or_falling_one():
    assert_learns([{"reward/mean": 0.2}] * 8 + [{"reward/mean": 0.5}] * 8)
    for last in (0.2, 0.29, 0.1):  # flat, risen by less than 0.1, fallen
        with pytest.raises(AssertionError):
            assert_learns([{"reward/mean": 0.2}] * 8 + [{"reward/mean": last}] * 8)


# A trajectory of 3 assistant tokens, a tool result of 2 tokens (masked, logprob 0, appended after a sync), then
# 2 more assistant tokens.
TRAJECTORY = {
    "num_tokens": 7,
    "response_ids": [5, 6, 7, 8, 9, 10, 11],
    "response_logprobs": [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5],
    "token_param_version": [0, 0, 0, 1, 1, 1, 1],
    "response_mask": [1, 1, 1, 0, 0, 1, 1],
    "agent_turns": [
        {"role": "assistant", "token_start": 0, "token_end": 3, "tool_name": None, "error": None, "latency_s": 0.2},
        {"role": "tool", "token_start": 3, "token_end": 5, "tool_name": "calculator", "error": None, "latency_s": 0.05},
        {"role": "assistant", "token_start": 5, "token_end": 7, "tool_name": None, "error": None, "latency_s": 0.1},
    ],
    "gen_latency_s": 0.4,
    "tool_latency_s": 0.05,
}


def _broken(change) -> dict:
    row = copy.deepcopy(TRAJECTORY)
    change(row)
    return row


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r["response_mask"].__setitem__(3, 1),  # a tool token trained on
        lambda r: r["response_mask"].__setitem__(1, 0),  # an assistant token masked
        lambda r: r["response_logprobs"].__setitem__(4, -0.7),  # a tool token with a logprob
        lambda r: r["token_param_version"].__setitem__(5, 0),  # a version older than the token before
        lambda r: r["agent_turns"][2].__setitem__("token_end", 6),  # turns that do not reach the end
        lambda r: r["response_ids"].pop(),  # a per-token column one short
        lambda r: r["agent_turns"][1].update(tool_name=None),  # a tool turn that names no tool and no error
        lambda r: r.update(tool_latency_s=0.35),  # the tool time counting the assistant turns too
    ],
    ids=[
        "tool-token-trained",
        "assistant-masked",
        "tool-logprob",
        "version-back",
        "turns-short",
        "ids-short",
        "no-tool",
        "tool-time",
    ],
)
def test_check_trajectory_fails_each_broken_trajectory(change):
    check_trajectory(TRAJECTORY)
    with pytest.raises(AssertionError):
        check_trajectory(_broken(change))


def test_is_loopback_tells_loopback_from_every_other_address():
    assert all(is_loopback(ip) for ip in ("127.0.0.1", "127.0.0.53", "::1", "::ffff:127.0.0.1"))
    assert not any(is_loopback(ip) for ip in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "::ffff:10.0.0.1"))
