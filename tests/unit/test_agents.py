"""Agent loops on a hand-written fake engine: the Hermes parser, the registry, single_turn_agent and tool_agent's
state machine, including a weight sync that lands while a response is generated and while a tool runs."""

from __future__ import annotations

import asyncio

import pytest

from stages.agents import AGENT_LOOP_NAMES, Segment, UnknownAgentError, agent_loop_class, check_agent_name
from stages.agents.hermes import parse_tool_calls
from stages.agents.single_turn import SingleTurnAgentLoop
from stages.agents.tool_agent import TOOL_RESPONSE, AgentState, ToolAgentLoop
from stages.tools import ToolError
from stages.tools.calculator import calculator

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'


# --- Hermes parser -----------------------------------------------------------------------------------------------
def test_parser_reads_one_well_formed_call():
    parsed = parse_tool_calls(CALL, max_calls=1)
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [("calculator", {"expression": "6 * 7"}, None)]
    assert parsed.content == "" and parsed.dropped == 0


def test_parser_keeps_text_around_calls_and_reads_several():
    text = f"Let me compute. {CALL} and {CALL.replace('6 * 7', '2 + 2')} done"
    parsed = parse_tool_calls(text, max_calls=4)
    assert [c.arguments["expression"] for c in parsed.calls] == ["6 * 7", "2 + 2"]
    assert parsed.content == "Let me compute.  and  done"


def test_parser_turns_malformed_json_into_an_error_not_an_exception():
    parsed = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expr</tool_call>', max_calls=2)
    (call,) = parsed.calls
    assert call.name is None and call.arguments is None and "not valid JSON" in call.error
    for body, message in [
        ("[1, 2]", "JSON object"),
        ('{"arguments": {}}', '"name"'),
        ('{"name": "x", "arguments": 3}', "arguments"),
    ]:
        assert message in parse_tool_calls(f"<tool_call>{body}</tool_call>", 1).calls[0].error


def test_parser_drops_calls_beyond_max_parallel_calls():
    parsed = parse_tool_calls(CALL * 3, max_calls=2)
    assert len(parsed.calls) == 2 and parsed.dropped == 1
    assert parse_tool_calls("no calls here", max_calls=2).calls == []


# --- registry ----------------------------------------------------------------------------------------------------
def test_registry_names_the_registered_loops_on_an_unknown_name():
    assert {"single_turn_agent", "single_turn", "tool_agent"} <= set(AGENT_LOOP_NAMES)
    assert agent_loop_class("single_turn") is agent_loop_class("single_turn_agent") is SingleTurnAgentLoop
    assert agent_loop_class("tool_agent") is ToolAgentLoop
    with pytest.raises(UnknownAgentError, match="registered: single_turn_agent, single_turn, tool_agent"):
        check_agent_name("react_agent", "row 3")


# --- a fake engine -----------------------------------------------------------------------------------------------
class FakeTokenizer:
    """One token per character (ids = code points), EOS = 0."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


class FakeEngine:
    """Plays scripted assistant turns (each ends with EOS). `abort_after = k` makes the next request stop after k
    tokens with finish_reason 'abort' and starts a sync, as vLLM's abort-mode pause does. `sync()` models the sync:
    the version goes up and until `resume()` the engine is paused (a request submitted meanwhile waits)."""

    def __init__(self, turns: list[str]) -> None:
        self.tokenizer = FakeTokenizer()
        self.turns = [[ord(c) for c in t] + [0] for t in turns]
        self.version, self.requests, self.emitted = 0, [], 0
        self.running = asyncio.Event()
        self.running.set()
        self.waiting = asyncio.Event()  # set once a request or an agent loop waits for a sync to end
        self.abort_after: int | None = None

    async def _until_running(self) -> None:
        if not self.running.is_set():
            self.waiting.set()
        await self.running.wait()

    async def segment(self, context, max_tokens, request_id):
        await self._until_running()  # a paused engine queues the request
        self.requests.append((request_id, len(context), max_tokens))
        turn = self.turns[0]
        want = min(max_tokens, self.abort_after if self.abort_after is not None else len(turn))
        take = turn[self.emitted : self.emitted + want]
        self.emitted += len(take)
        seg = Segment(take, [-0.5] * len(take), [self.version] * len(take), "stop")
        if self.abort_after is not None:  # a sync starts now and aborts this request
            self.abort_after, seg.finish_reason = None, "abort"
            self.sync()
        elif self.emitted >= len(turn):
            self.turns.pop(0)
            self.emitted = 0
        else:
            seg.finish_reason = "length"
        return seg

    def current_version(self):
        return self.version

    async def wait_running(self):
        if self.running.is_set():
            return False
        await self._until_running()
        return True

    def sync(self):
        self.running.clear()
        self.version += 1

    def resume(self):
        self.running.set()


def run(coro):
    return asyncio.run(coro)


def test_single_turn_resumes_an_aborted_request_with_the_new_weights():
    engine = FakeEngine(["hello world"])
    engine.abort_after = 5

    async def go():
        loop = SingleTurnAgentLoop(engine, max_tokens=64)
        task = asyncio.create_task(loop.run([1, 2, 3], "p/0"))
        await engine.waiting.wait()  # first segment: 5 tokens at version 0, then the sync aborts it
        assert not engine.running.is_set() and len(engine.requests) == 1  # the resubmitted request waits
        engine.resume()
        return await task

    traj = run(go())
    assert engine.tokenizer.decode(traj.tokens) == "hello world"
    assert traj.versions == [0] * 5 + [1] * 7 and traj.mask == [1] * 12 and traj.turns == []
    assert traj.num_resumes == 1 and traj.finish_reason == "stop"
    assert [r[0] for r in engine.requests[:2]] == ["p/0#0", "p/0#1"]  # the stage's request ids, unchanged
    assert engine.requests[1][1:] == (3 + 5, 64 - 5)  # prompt + partial, the remaining budget


class SlowCalculator:
    """The calculator, but it waits for `release`: a test can hold a tool run open across a sync."""

    def __init__(self) -> None:
        self.started, self.release = asyncio.Event(), asyncio.Event()

    async def __call__(self, arguments):
        self.started.set()
        await self.release.wait()
        return await calculator(arguments)


def tool_loop(engine, tools, **limits):
    return ToolAgentLoop(engine, max_tokens=limits.pop("max_tokens", 400), multi_turn=limits, tools=tools)


def test_tool_agent_masks_exactly_the_tool_result_tokens():
    engine = FakeEngine([CALL, " 42"])
    traj = run(tool_loop(engine, {"calculator": calculator}).run([5], "p/0"))
    result = TOOL_RESPONSE.format("42")
    assert engine.tokenizer.decode(traj.tokens) == CALL + result + " 42"
    expected = [1] * (len(CALL) + 1) + [0] * len(result) + [1] * 4
    assert traj.mask == expected
    assert len(traj.tokens) == len(traj.logprobs) == len(traj.versions) == len(traj.mask)
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.mask, strict=True) if m == 0)
    roles = [(t["role"], t["token_start"], t["token_end"]) for t in traj.turns]
    call_end = len(CALL) + 1
    assert roles == [
        ("assistant", 0, call_end),
        ("tool", call_end, call_end + len(result)),
        ("assistant", call_end + len(result), len(traj.tokens)),
    ]
    tool_turn = traj.turns[1]
    assert tool_turn["tool_name"] == "calculator" and tool_turn["result"] == "42" and tool_turn["error"] is None
    assert '"6 * 7"' in tool_turn["arguments"]
    # The second request continues from prompt + everything so far, the tool's result included.
    assert engine.requests[1][1] == 1 + call_end + len(result)


def test_tool_agent_pauses_while_a_tool_runs_and_resumes_with_the_new_weights():
    engine, tool = FakeEngine([CALL, " 42"]), SlowCalculator()
    states = []

    async def go():
        loop = tool_loop(engine, {"calculator": tool})
        loop.on_state = states.append
        task = asyncio.create_task(loop.run([5], "p/0"))
        await tool.started.wait()  # PROCESSING_TOOLS: the tool is running
        engine.sync()  # a sync starts: it does not wait for the tool
        tool.release.set()  # the tool finishes during the sync
        await engine.waiting.wait()
        assert not task.done() and len(engine.requests) == 1  # the loop waits for the sync to end
        engine.resume()
        return await task

    traj = run(go())
    call_end = len(CALL) + 1
    result_len = len(TOOL_RESPONSE.format("42"))
    assert states == [AgentState.PENDING, AgentState.GENERATING, AgentState.PROCESSING_TOOLS, AgentState.GENERATING]
    # The call was sampled by version 0; the result was appended after the sync (version 1), the answer by version 1.
    assert traj.versions == [0] * call_end + [1] * result_len + [1] * 4
    assert traj.num_resumes == 1 and traj.turns[1]["result"] == "42"


def test_tool_agent_pauses_in_generating_and_resumes_the_partial_turn():
    engine = FakeEngine([CALL, " 42"])
    engine.abort_after = 10

    async def go():
        task = asyncio.create_task(tool_loop(engine, {"calculator": calculator}).run([5], "p/0"))
        await engine.waiting.wait()  # 10 tokens of the call at version 0, then the sync aborts the request
        assert not engine.running.is_set() and len(engine.requests) == 1
        engine.resume()
        return await task

    traj = run(go())
    assert engine.tokenizer.decode(traj.tokens).startswith(CALL)
    assert traj.versions[:10] == [0] * 10 and set(traj.versions[10:]) == {1}
    assert traj.num_resumes == 1 and traj.turns[1]["result"] == "42"
    assert engine.requests[1][0] == "p/0@t0#1" and engine.requests[1][1] == 1 + 10


def test_tool_errors_go_to_the_model_and_the_turn_record():
    async def broken(arguments):
        raise RuntimeError("disk on fire")

    async def refusing(arguments):
        raise ToolError("no such thing")

    cases = [
        ('<tool_call>{"name": "calculator", "arguments": {"expr</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'"),
        ('<tool_call>{"name": "broken", "arguments": {}}</tool_call>', "raised RuntimeError: disk on fire"),
        ('<tool_call>{"name": "refusing", "arguments": {}}</tool_call>', "no such thing"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>', "division by zero"),
    ]
    for call, message in cases:
        engine = FakeEngine([call, " ?"])
        tools = {"calculator": calculator, "broken": broken, "refusing": refusing}
        traj = run(tool_loop(engine, tools).run([5], "p/0"))
        turn = traj.turns[1]
        assert turn["role"] == "tool" and message in turn["error"] and turn["result"] is None
        assert message in engine.tokenizer.decode(traj.tokens)  # the model is told
        assert traj.turns[-1]["role"] == "assistant"


def test_tool_agent_limits_turns_calls_and_tokens():
    # max_assistant_turns=1: the call is generated but not run.
    traj = run(tool_loop(FakeEngine([CALL]), {"calculator": calculator}, max_assistant_turns=1).run([5], "p/0"))
    assert [t["role"] for t in traj.turns] == ["assistant"]
    # max_parallel_calls=2 runs two of three calls, one tool turn each, concurrently.
    engine = FakeEngine([CALL * 3, " 42"])
    traj = run(tool_loop(engine, {"calculator": calculator}, max_parallel_calls=2).run([5], "p/0"))
    assert [t["role"] for t in traj.turns] == ["assistant", "tool", "tool", "assistant"]
    # A tool result that does not fit the token budget is cut and the trajectory ends at the budget.
    engine = FakeEngine([CALL, " 42"])
    traj = run(tool_loop(engine, {"calculator": calculator}, max_tokens=len(CALL) + 5).run([5], "p/0"))
    assert len(traj.tokens) == len(CALL) + 5 and traj.finish_reason == "length" and traj.mask[-1] == 0


# --- what the trainer and the audit make of masked tokens ----------------------------------------------------------
def test_the_loss_ignores_masked_tool_tokens():
    import torch

    from stages.trainer.loss import AggCounts
    from stages.trainer.policy_loss import LossInputs
    from stages.trainer.policy_loss.clip import vanilla
    from stages.trainer.settings import PolicySettings

    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])  # (1, 5): two tool-result tokens in the middle
    old = torch.tensor([[-0.5, -0.5, 0.0, 0.0, -0.5]])  # their behaviour logprob is 0.0, as the loop writes it

    def loss_of(logp: torch.Tensor) -> torch.Tensor:
        x = LossInputs(logp, old, torch.ones(1, 5), mask, AggCounts(3, 1, 5), "token-mean")
        return vanilla(x, PolicySettings(clip_ratio_high=0.28)).loss

    logp = torch.tensor([[-0.4, -0.6, -3.0, -7.0, -0.5]], requires_grad=True)
    loss = loss_of(logp)
    loss.backward()
    assert logp.grad[0, 2] == 0.0 and logp.grad[0, 3] == 0.0 and logp.grad[0, 0] != 0.0
    other = torch.tensor([[-0.4, -0.6, -0.1, -0.2, -0.5]])
    assert torch.isclose(loss_of(other), loss.detach())


def test_the_audit_checks_that_per_token_columns_line_up():
    import pyarrow as pa

    from pipeline.observe.audit_tokens import per_token_columns

    good = {"sample_id": "p/0", "num_tokens": 3, "response_ids": [1, 2, 3], "response_logprobs": [-0.1, 0.0, -0.2]}
    good |= {"token_param_version": [0, 1, 1], "response_mask": [1, 0, 1]}
    assert per_token_columns(pa.Table.from_pylist([good])).ok
    for bad in ({**good, "response_logprobs": [-0.1, -0.3, -0.2]}, {**good, "response_mask": [1, 0]}):
        assert not per_token_columns(pa.Table.from_pylist([good, bad])).ok
