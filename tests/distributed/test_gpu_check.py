"""The GPU check's CPU rehearsal (bench/gpu_check): every piece on CPU with the tiny model, its weight push over
gloo to a receiver process, with the assertions it makes on a GPU; and a push whose receiver keeps its old weights
fails the check.

On a GPU the same pieces compare CUDA with the CPU (make gpu-check); here the device is the CPU, so the fp32
comparisons are exact and what is really checked is bf16 against fp32, FSDP2 as a one-rank world, Megatron's CPU
step lowering the loss, routing replay and the push's values.
"""

from bench.gpu_check import transport
from bench.gpu_check.__main__ import main
from bench.gpu_check.report import load


class KeepsOldWeights(transport.LoadsIntoModel):
    """A receiver that takes every tensor of a push and loads none: it keeps the weights it started with."""

    def reload_weights(self, weights_iterator) -> None:
        for _ in weights_iterator:
            pass


def test_every_piece_passes_its_checks_on_cpu(tmp_path):
    assert main(["--device", "cpu", "--size", "tiny", "--jobs", "2", "--out", str(tmp_path)]) == 0
    records = load(tmp_path / "results.json")
    pieces = " | ".join(r.piece for r in records)
    expected = ["torch single rank bf16", "torch FSDP2, one rank bf16", "megatron TP=PP=1 fp32", "R3 replay, torch"]
    expected += [
        "R3 replay, megatron",
        "reference model",
        "weight push (gloo)",
        "packed + token budget + checkpointing bf16",
    ]
    assert all(piece in pieces for piece in expected), pieces
    assert all(r.ok and r.checks for r in records)
    assert "| weight push (gloo) to a receiver process | cpu |" in (tmp_path / "table.md").read_text()


def test_a_push_that_leaves_the_receivers_old_weights_fails_the_check(tmp_path):
    record = transport.run("cpu", "tiny", tmp_path, runner_cls=KeepsOldWeights)
    failed = [c.what for c in record.checks if not c.ok]
    assert failed == ["tensors unequal to the trainer's", "tensors changed by the push"]
    assert not record.ok
