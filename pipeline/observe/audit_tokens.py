"""The audit's rules on each sample's token columns: versions that never decrease and start no earlier than the
prompt's admission, per-token columns of one length with masked tokens at logprob 0, one MoE route row per context
token. Each takes the whole sample log and names the first samples that break it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
from omegaconf import OmegaConf

from pipeline.observe.audit_check import Check, examples
from pipeline.observe.reward_audit import left_out


def versions_never_decrease(samples: pa.Table) -> Check:
    """Token versions never decrease along a response, and param_version is its first token's."""
    bad = []
    rows = zip(
        samples["sample_id"].to_pylist(),
        samples["token_param_version"].to_pylist(),
        samples["param_version"].to_pylist(),
        strict=True,
    )
    for sid, versions, oldest in rows:
        if not versions:
            continue
        if versions[0] != oldest:
            bad.append(f"{sid} (first token at {versions[0]}, param_version {oldest})")
        elif any(b < a for a, b in zip(versions, versions[1:], strict=False)):
            at = next(i for i, (a, b) in enumerate(zip(versions, versions[1:], strict=False)) if b < a)
            bad.append(f"{sid} (token {at + 1}: {versions[at]} -> {versions[at + 1]})")
    return Check(
        "token versions never decrease",
        not bad,
        f"{len(bad)} of {samples.num_rows} responses violate it{examples(bad)}",
    )


def no_token_older_than_admission(samples: pa.Table, admitted: pa.Table) -> Check:
    """An engine generates a prompt only with weights at least as new as the version that admitted it (pull mode:
    a replica behind waits for them), so no token of a response is older than its prompt's admission; a sample's
    admitted_version is the ledger's."""
    ledger = dict(zip(admitted["prompt_id"].to_pylist(), admitted["admitted_version"].to_pylist(), strict=True))
    bad = []
    columns = ("sample_id", "prompt_id", "admitted_version", "token_param_version")
    for sid, pid, at, versions in zip(*(samples[c].to_pylist() for c in columns), strict=True):
        if pid in ledger and ledger[pid] != at:
            bad.append(f"{sid} (admitted at {at}, the ledger says {ledger[pid]})")
        elif versions and min(versions) < at:
            bad.append(f"{sid} (a token at version {min(versions)}, admitted at {at})")
    return Check(
        "no token older than its admission",
        not bad,
        f"{len(bad)} of {samples.num_rows} responses violate it{examples(bad)}",
    )


def per_token_columns(samples: pa.Table) -> Check:
    """Every per-token column has num_tokens entries, and masked tokens (an agent loop's tool results) carry
    logprob 0: the trainer's response_mask then drops exactly them, and their versions stay in the lag bound. A
    sample whose reward left it out of the loss is masked whole, generated tokens included (reward_audit checks it)."""
    columns = ["sample_id", "num_tokens", "response_ids", "response_logprobs", "token_param_version", "response_mask"]
    bad, masked = [], 0
    rows = zip(left_out(samples), *(samples[c].to_pylist() for c in columns), strict=True)
    for reward_left_out, sid, n, ids, logprobs, versions, mask in rows:
        lengths = [len(c) if c is not None else None for c in (ids, logprobs, versions, mask)]
        zeros = [] if reward_left_out else [i for i, m in enumerate(mask or []) if m == 0]
        masked += len(zeros)
        if lengths != [n] * 4:
            bad.append(f"{sid} (num_tokens {n}; ids, logprobs, versions, mask {lengths})")
        elif any(logprobs[i] != 0.0 for i in zeros):
            bad.append(f"{sid} (a masked token with logprob != 0)")
    return Check(
        "per-token columns line up",
        not bad,
        f"{len(bad)} of {samples.num_rows} responses violate it; {masked} masked (tool) tokens{examples(bad)}",
    )


def route_width(run_dir: Path) -> int | None:
    """layers * k of the run's model (a row of routed_experts), from its config.json; None if it cannot tell.

    MoE layers follow the Qwen-MoE convention (every decoder_sparse_step-th layer, minus mlp_only_layers)."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    path = run_dir / "model" if cfg.model.path == "embedded" else Path(cfg.model.path)
    try:
        model = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    k, layers = model.get("num_experts_per_tok"), model.get("num_hidden_layers")
    if not k or not layers:
        return None
    step, dense = model.get("decoder_sparse_step") or 1, set(model.get("mlp_only_layers") or [])
    return k * sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def route_rows(samples: pa.Table, width: int | None) -> Check:
    """Samples with routes have one row per token of prompt + response but the last, each of layers * k expert ids
    (one width for all when the model's config cannot tell it): routes appended on a resume would show here."""
    bad = []
    widths: set[int] = set()
    columns = ("sample_id", "prompt_ids", "response_ids", "routed_experts")
    for sid, prompt, response, routes in zip(*(samples[c].to_pylist() for c in columns), strict=True):
        if routes is None:
            continue
        widths.update(len(r) for r in routes)
        if len(routes) != len(prompt) + len(response) - 1 or any(len(r) != (width or len(routes[0])) for r in routes):
            bad.append(f"{sid} ({len(routes)} rows for {len(prompt) + len(response)} context tokens)")
    uniform = width is not None or len(widths) <= 1
    return Check(
        "routes: one row per context token",
        not bad and uniform,
        f"{len(bad)} of {samples.num_rows} responses violate it; row width {sorted(widths)}, model's "
        f"{width or 'unknown'}{examples(bad)}",
    )
