"""Runs that resume under Lightning and the HF Trainer: the step goes on from the trainer's restored global step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gradwatch as gw

pytestmark = pytest.mark.slow  # real Lightning and Hugging Face trainers


def test_lightning_resumes_from_the_checkpoints_global_step(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    from gradwatch.integrations.lightning import GradWatchCallback
    from tests.test_lightning import Net, loader, trainer

    run, ckpt = tmp_path / "run", tmp_path / "step5.ckpt"
    first = trainer([GradWatchCallback(run=run, console=False, resume=True)], max_steps=5)
    first.fit(Net(), loader())  # no stored run yet: resume=True starts it
    first.save_checkpoint(ckpt)
    # the earlier process goes on past its checkpoint (to step 8) before it is preempted
    trainer([GradWatchCallback(run=run, console=False, resume=True)], max_steps=8).fit(Net(), loader(),
                                                                                      ckpt_path=ckpt)
    # the restarted job goes on from the checkpoint of step 5: steps 5..7 of the earlier process are superseded
    trainer([GradWatchCallback(run=run, console=False, resume=True)], max_steps=10).fit(Net(), loader(),
                                                                                       ckpt_path=ckpt)
    with gw.open_run(run) as stored:
        assert [(r["step"], r["superseded"]) for r in stored.restarts] == [(5, 0), (5, 3)]
        assert list(stored.step_info()["step"]) == list(range(10)) and stored.status == "finished"
        assert list(stored.superseded("steps")["step"]) == [5, 6, 7]


def test_hf_trainer_resumes_from_its_checkpoints_global_step(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from gradwatch.integrations.transformers import GradWatchCallback
    from tests.test_transformers_trainer import Tokens, tiny_gpt2

    run, out = tmp_path / "run", tmp_path / "out"

    def train(max_steps: int, resume_from: str | None) -> None:
        torch.manual_seed(0)
        args = transformers.TrainingArguments(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
                                              save_strategy="steps", save_steps=4, report_to=[], use_cpu=True,
                                              disable_tqdm=True, learning_rate=1e-3)
        callback = GradWatchCallback(run=run, console=False, resume=True)
        transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(),
                             callbacks=[callback]).train(resume_from_checkpoint=resume_from)

    train(6, None)  # checkpoint-4 is saved; the process records steps 0..5
    train(9, str(out / "checkpoint-4"))  # a restart from step 4: the earlier steps 4 and 5 are superseded
    with gw.open_run(run) as stored:
        assert [(r["step"], r["superseded"]) for r in stored.restarts] == [(4, 2)]
        assert list(stored.step_info()["step"]) == list(range(9)) and stored.status == "finished"


def test_a_resumed_lightning_run_counts_findings_in_its_logger_as_check_does(tmp_path: Path) -> None:
    """Issue 35, item 4: the stored finding repeated before the restart counts once, its repeats apart."""
    pl = pytest.importorskip("lightning.pytorch")
    import csv
    import json

    from gradwatch.integrations.lightning import GradWatchCallback
    from tests.test_check import gradwatch
    from tests.test_lightning import Net, loader, trainer

    run, ckpt = tmp_path / "run", tmp_path / "step5.ckpt"
    nan_batches = loader(16)
    for batch in (1, 2, 3):  # one nonfinite error, three occurrences, all before the checkpoint
        nan_batches.dataset.tensors[0][batch * 4, 0] = -1.0
    first = trainer([GradWatchCallback(run=run, console=False, resume=True)], max_steps=5)
    first.fit(Net(), nan_batches)
    first.save_checkpoint(ckpt)
    logger = pl.loggers.CSVLogger(tmp_path / "logs", name="", version="")
    trainer([GradWatchCallback(run=run, console=False, resume=True)], max_steps=10, logger=logger,
            log_every_n_steps=1).fit(Net(), loader(16), ckpt_path=ckpt)  # clean batches after the restart
    checked = json.loads(gradwatch("check", str(run), "--format", "json").stdout)
    assert [(f["step"], f["kind"], f["repeats"]) for f in checked["findings"] if f["severity"] == "error"] == [
        (1, "nonfinite", 3)]
    with open(tmp_path / "logs" / "metrics.csv") as f:
        last = [r for r in csv.DictReader(f) if r.get("gradwatch/errors")][-1]
    assert int(last["step"]) == 9
    assert float(last["gradwatch/errors"]) == 1 and float(last["gradwatch/repeats"]) == 2
