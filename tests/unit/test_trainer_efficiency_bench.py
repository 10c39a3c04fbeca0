"""bench.trainer_efficiency runs (a tiny model, one step per variant) and reports what it says it reports: every
variant's step time and peak memory against padded's, and the tokens each computes (packed: only the real ones)."""

from bench.trainer_efficiency import VARIANTS, main


def test_the_smoke_run_reports_every_variant():
    results = main(["--smoke"])
    assert set(results) == {("smoke", v) for v in VARIANTS}
    real = results[("smoke", "packed")]["computed_tokens"]
    assert results[("smoke", "padded")]["computed_tokens"] > real  # the padding a long tail costs
    assert all(results[("smoke", v)]["computed_tokens"] == real for v in VARIANTS if v != "padded")
    padded = results[("smoke", "padded")]
    assert padded["step_ratio"] == padded["peak_ratio"] == 1.0
    dtypes = {v: results[("smoke", v)]["dtype"] for v in VARIANTS}  # the trainer's compute dtype
    assert dtypes.pop("packed_bf16") == "bfloat16" and set(dtypes.values()) == {"float32"}
    for res in results.values():
        assert res["step_s"] > 0 and res["peak_mb"] > 0
