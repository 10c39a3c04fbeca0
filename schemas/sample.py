"""The Arrow schema of a sample batch: every column the stream carries, declared once.

A row is one trajectory (one of the `rollout.n` responses to a prompt). The rows of a GRPO group
(same `prompt_id`) always travel in the same block.

Invariants:
- `response_ids`, `response_logprobs`, `token_param_version`, `response_mask`, `token_advantages` and (when
  present) `ref_logprobs` have the same length, `num_tokens`. Tokens an agent loop appended (tool results) have
  mask 0, logprob 0.0 and the weight version current when they were appended (never older than the token before).
- `param_version` is the oldest entry of `token_param_version` (the weights that started the response);
  `param_version_end` the newest. They differ only for partial rollouts.
- A sample's lag is `consumed_version - param_version`; the run's config bounds it (stages.staleness).
- Times are seconds since the epoch (float64), measured where the stage runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    doc: str


def _col(name: str, type_: pa.DataType, doc: str) -> Column:
    return Column(name, type_, doc)


# One turn of an agent loop (stages/agents). Tokens [token_start, token_end) of the response belong to the turn;
# the tool fields are null on assistant turns, `error` null when the turn went well.
AGENT_TURN = pa.struct(
    [
        pa.field("turn", pa.int32()),  # index of the turn in the trajectory
        pa.field("role", pa.string()),  # 'assistant' or 'tool'
        pa.field("token_start", pa.int32()),
        pa.field("token_end", pa.int32()),
        pa.field("tool_name", pa.string()),
        pa.field("arguments", pa.string()),  # the call's arguments as JSON text
        pa.field("result", pa.string()),  # the text handed back to the model
        pa.field("latency_s", pa.float64()),  # generation time of an assistant turn, run time of a tool call
        pa.field("error", pa.string()),
    ]
)

# Columns of a prompt row, as the source emits it.
PROMPT_COLUMNS = (
    _col("prompt_id", pa.string(), "unique id of the prompt admission (epoch and row); one GRPO group"),
    _col("prompt_text", pa.string(), "prompt as text, for logs and notebooks"),
    _col("prompt_ids", pa.list_(pa.int32()), "prompt token ids, validated against the vocabulary"),
    _col("ground_truth", pa.string(), "reference answer the verifier compares against"),
    _col("data_source", pa.string(), "task name; selects the verifier"),
    _col(
        "agent_name",
        pa.string(),
        "agent loop that generates the responses (stages/agents); from the data, else rollout.agent.default_agent_loop",
    ),
)

# Added by the StalenessGate.
GATE_COLUMNS = (
    _col("admitted_version", pa.int64(), "weight version of the clock when the gate admitted the prompt"),
    _col("admitted_time", pa.float64(), "when the prompt was admitted (s since epoch)"),
)

# Added by Generate, one row per trajectory.
GENERATE_COLUMNS = (
    _col("sample_id", pa.string(), "unique id of the trajectory: '<prompt_id>/<index in group>'"),
    _col("response_ids", pa.list_(pa.int32()), "generated token ids"),
    _col("response_text", pa.string(), "generated text, decoded"),
    _col("response_logprobs", pa.list_(pa.float32()), "behaviour logprob of each response token"),
    _col("token_param_version", pa.list_(pa.int64()), "weight version that produced each response token"),
    _col("param_version", pa.int64(), "oldest token version (the weights that started the response)"),
    _col("param_version_end", pa.int64(), "newest token version"),
    _col("response_mask", pa.list_(pa.int8()), "1 where the token is trained on, 0 for masked tokens"),
    _col("num_tokens", pa.int32(), "number of response tokens"),
    _col(
        "num_resumes", pa.int32(), "times a weight sync interrupted the response (mid-generation or during a tool call)"
    ),
    _col("finish_reason", pa.string(), "'stop' (EOS, or an agent loop ended) or 'length' (hit max_tokens)"),
    _col("replica", pa.int32(), "index of the Generate replica that produced the response"),
    _col("generated_time", pa.float64(), "when the last token was produced (s since epoch)"),
    _col("gen_latency_s", pa.float64(), "wall time from the engine accepting the prompt to the last token"),
    _col("tool_latency_s", pa.float64(), "run time of the trajectory's tool calls, summed (part of gen_latency_s)"),
    _col(
        "agent_turns",
        pa.list_(AGENT_TURN),
        "one record per turn of the agent loop (assistant turns, tool calls); empty for single_turn",
    ),
)

# Added by RefLogprob, when a reference policy is configured (a KL loss or a KL penalty in the reward); null
# otherwise. Optional: the stages that take "every column" do not require it.
REFERENCE_COLUMNS = (
    _col("ref_logprobs", pa.list_(pa.float32()), "logprob of each response token under the frozen initial policy"),
)

# Added by Generate when the engine captures the MoE routes (actor.router_replay); null otherwise. Optional.
ROUTING_COLUMNS = (
    _col(
        "routed_experts",
        pa.list_(pa.list_(pa.uint8())),
        "the experts the engine's routers chose: one row per token of prompt_ids + response_ids except the last "
        "(the last is never fed back), each row every MoE layer's top-k expert ids, layer after layer (layers x k "
        "values). Always the engine's latest full-context routes: replaced, never appended, when a response resumes",
    ),
    _col(
        "routes_version",
        pa.int64(),
        "the weight version whose prefill computed the routed_experts rows of the latest request's context (that "
        "request's first token's version). A row computed later, while that request decoded, has the version of the "
        "token it predicts: a row's version is max(routes_version, version of the token after it)",
    ),
)

# Added by Reward and Advantage.
REWARD_COLUMNS = (
    _col("reward", pa.float32(), "the sample's reward (the sources' score); 0 when scoring failed"),
    _col(
        "reward_error",
        pa.string(),
        "why scoring failed on this sample (the failing source's reason), null when it succeeded",
    ),
    _col(
        "reward_extra_info",
        pa.string(),
        "a reward function's extra keys when it returned a dict (JSON object text), null otherwise",
    ),
)
# One reward source's work on one sample (stages/reward_sources.py): the model, service or function that scored it.
SOURCE_RECORD = pa.struct(
    [
        pa.field("score", pa.float32()),  # null when the source failed on the sample
        pa.field("error", pa.string()),  # why it failed (its last attempt's reason), null when it scored
        pa.field("latency_s", pa.float64()),  # the source's time on the sample (see the column's doc)
        pa.field("attempts", pa.int32()),  # calls made for the sample: 1, or more when it was retried
        pa.field("output", pa.string()),  # what a generative source said (a judge's verdict), null for the others
    ]
)
# Added by the reward step (stages/reward_sources.py) when it runs; absent from hand-built batches, whose rewards all
# count as scored. Optional.
REWARD_SOURCE_COLUMNS = (
    _col(
        "reward_sources",
        pa.map_(pa.string(), SOURCE_RECORD),
        "every reward source that worked on the sample, by name ('rule', 'custom', 'reward_model', 'judge', "
        "'remote'): its score, error, attempts and latency_s (a remote service's request round trips, retries and "
        "backoff included; a reward model's micro-batch forward pass; a judge's request and parse; a rule or custom "
        "function's whole block, whose samples are scored side by side), and a judge's verdict text (output)",
    ),
    _col(
        "reward_status",
        pa.string(),
        "'ok' (scored); or what reward.on_error made of a failed reward: 'zero' (trained with reward 0), 'masked' "
        "(left out of the loss and of its group's statistics), 'dropped' (its group had a failed sample and left the "
        "loss whole)",
    ),
)
ADVANTAGE_COLUMNS = (
    _col("advantage", pa.float32(), "the trajectory's advantage (its first trained token's for per-token estimators)"),
    _col(
        "token_advantages",
        pa.list_(pa.float32()),
        "advantage of each response token (length of response_ids; 0 where response_mask is 0); what the trainer "
        "uses. Estimators that whiten over the training step (reinforce_plus_plus*) log it before the whitening; "
        "the optimal-token-baseline pair logs the returns, from which the trainer subtracts its baseline",
    ),
)

# Added by the advantage stage when the KL is in the reward (algorithm.use_kl_in_reward); null otherwise. Optional.
REWARD_KL_COLUMNS = (
    _col(
        "reward_kl",
        pa.float32(),
        "masked mean over the response of kl(behaviour, reference) per token: the KL the reward paid for, per token",
    ),
)

# Added by the training sink when it consumes a sample.
TRAIN_COLUMNS = (
    _col("consumed_version", pa.int64(), "trainer weight version when the sample was trained on"),
    _col("consumed_step", pa.int64(), "optimizer step that used the sample (1-based)"),
    _col("consumed_time", pa.float64(), "when the trainer consumed the sample (s since epoch)"),
)

# Added by the training sink to the groups dynamic sampling filters (stages/group_filter.py), which are never trained.
FILTER_COLUMNS = (
    _col("filtered_version", pa.int64(), "the clock's weight version when the sink filtered the sample's group"),
    _col("filtered_step", pa.int64(), "the step the sink was filling when it filtered the group (1-based)"),
    _col(
        "filtered_value",
        pa.float64(),
        "the filter metric's value, the same for every response of the group (null when the reason is reward_failed)",
    ),
    _col(
        "filtered_reason",
        pa.string(),
        "why the group was left out: 'flat' (dynamic sampling: its metric has no spread) or 'reward_failed' "
        "(reward.on_error=drop_group: a sample's reward failed)",
    ),
)

ALL_COLUMNS = (
    PROMPT_COLUMNS
    + GATE_COLUMNS
    + GENERATE_COLUMNS
    + REFERENCE_COLUMNS
    + ROUTING_COLUMNS
    + REWARD_COLUMNS
    + REWARD_SOURCE_COLUMNS
    + ADVANTAGE_COLUMNS
    + REWARD_KL_COLUMNS
)
SAMPLE_SCHEMA = pa.schema([pa.field(c.name, c.type) for c in ALL_COLUMNS])
OPTIONAL_COLUMNS = tuple(
    c.name for c in REFERENCE_COLUMNS + ROUTING_COLUMNS + REWARD_SOURCE_COLUMNS + REWARD_KL_COLUMNS
)
# Columns that grow with the tokens (a value per token or per turn, and the texts the tokens decode to): what the
# driver leaves in the object store for the trainer to fetch (stages/handoff.py).
PER_TOKEN_COLUMNS = tuple(
    f.name for f in SAMPLE_SCHEMA if pa.types.is_list(f.type) or f.name in ("prompt_text", "response_text")
)
# The hand-off's columns on the light rows the stream delivers (stages/handoff.py): the key of the per-token table in
# the object store that holds the rest of each row, and that table's rows and bytes.
TOKEN_TABLE_COLUMNS = ("token_table", "token_table_rows", "token_table_bytes")
# What a stage that takes "every column" requires: all but the optional ones.
REQUIRED_COLUMNS = tuple(n for n in SAMPLE_SCHEMA.names if n not in OPTIONAL_COLUMNS)
# The sink's consumption log: one row per trained trajectory, joined to the sample log by sample_id.
CONSUMED_SCHEMA = pa.schema(
    [pa.field("sample_id", pa.string()), pa.field("prompt_id", pa.string())]
    + [pa.field(c.name, c.type) for c in TRAIN_COLUMNS]
)
# The sink's filter log: one row per trajectory of a group dynamic sampling left out (algorithm.filter_groups).
FILTERED_SCHEMA = pa.schema(
    [pa.field("sample_id", pa.string()), pa.field("prompt_id", pa.string())]
    + [pa.field(c.name, c.type) for c in FILTER_COLUMNS]
)
# The gate's admission log: one row per admitted prompt.
ADMITTED_SCHEMA = pa.schema([pa.field("prompt_id", pa.string())] + [pa.field(c.name, c.type) for c in GATE_COLUMNS])
COLUMN_DOCS = {c.name: c.doc for c in ALL_COLUMNS + TRAIN_COLUMNS + FILTER_COLUMNS}


# prompt_id of the last row of every stream. The gate holds it until the trainer is done, so the stream (and with it
# the engines that weight syncs must reach) stays up for the whole run, even after the last prompt was generated.
END_OF_STREAM = "__end_of_stream__"


class MissingColumnsError(KeyError):
    """A stage received a batch without the columns it needs."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def require_columns(batch, columns: tuple[str, ...] | list[str], where: str) -> None:
    """Raise one clear error naming every missing column and the stage that needed it."""
    present = set(batch.keys()) if hasattr(batch, "keys") else set(batch.column_names)
    missing = [c for c in columns if c not in present]
    if missing:
        raise MissingColumnsError(
            f"{where} needs column(s) {missing} but the batch has {sorted(present)}. "
            f"Check the stage order in the config: the stage that adds {missing[0]!r} must run before {where}."
        )
