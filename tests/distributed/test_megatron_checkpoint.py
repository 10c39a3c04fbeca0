"""A Megatron checkpoint resumes exactly: the step after a save gives the same loss, grad norm and weights in the
trainer that saved it and in a fresh trainer built from the checkpoint (its HF model and AdamW state).

Each trainer runs in its own spawned process (a MegatronTrainer owns its process's torch.distributed world).
"""

import torch.multiprocessing as mp

from pipeline.tasks.embedded import build_embedded
from stages.trainer.settings import PolicySettings
from tests.distributed.megatron_layouts import minibatch as _minibatch


def _trainer(model_dir: str, queue, save_to: str = "", optimizer_state: str | None = None) -> None:
    from stages.trainer.megatron_backend import MegatronTrainer

    trainer = MegatronTrainer(model_dir, PolicySettings(lr=1e-4, micro_batch_size=4), optimizer_state=optimizer_state)
    mb = _minibatch(1)
    mb["response_logprobs"] = [[-5.0] * len(r) for r in mb["response_ids"]]
    if save_to:
        trainer.train_step([mb])
        trainer.save_checkpoint(save_to)
    step = trainer.train_step([mb])
    queue.put({"step": step, "weights": {n: t.numpy().copy() for n, t in trainer._stream()}})


def _run(*args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_trainer, args=(*args[:1], queue, *args[1:]))
    proc.start()
    result = queue.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    return result


def test_checkpoint_resumes_the_next_step_exactly(tmp_path):
    import numpy as np

    task = build_embedded(tmp_path / "task", 10, seed=4)
    ckpt = tmp_path / "ckpt"
    original = _run(str(task.model_dir), str(ckpt))
    assert (ckpt / "model" / "config.json").exists() and (ckpt / "model" / "tokenizer.json").exists()
    resumed = _run(str(ckpt / "model"), "", str(ckpt / "optimizer.pt"))
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert resumed["step"][key] == original["step"][key], key
    for name, value in original["weights"].items():
        np.testing.assert_array_equal(resumed["weights"][name], value, err_msg=name)
