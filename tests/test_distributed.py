"""torch.distributed: two real processes on the gloo backend, each watching its DDP replica.

The two ranks are started once (``tests/ranks.py``: starting a process that imports torch costs
seconds) and play every scenario in turn, each in a process group of its own (initialised and
destroyed as a training script does) with its own run, and each test reads its scenario's results.
"""

from __future__ import annotations

import json
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradwatch as gw

from .ranks import leave_group, spawn_ranks

pytestmark = pytest.mark.slow  # two real processes on the gloo backend

WORLD = 2
STEPS = 12
SCENARIOS = ("healthy", "nan", "divergence", "halt", "fsdp", "fsdp_last_sampled", "fail_in_step",
             "fail_between_steps", "rollback_unwritable", "rollback_lost", "rollback_diverged")
#: a collective that waits longer than this raises on its rank (a deadlock fails its scenario, not the others)
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def worker(rank: int, port: int, out: str, scenarios: tuple[str, ...]) -> None:
    """One rank: every scenario in turn, each writing its results to ``out/<scenario>/rank{rank}.json``.

    The ranks meet at one TCP store (rank 0's, on ``port``); each scenario's process group has its
    own keys in it.
    """
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT)
    for scenario in scenarios:
        with warnings.catch_warnings():  # a scenario's warning filters end with it
            play(rank, dist.PrefixStore(scenario, store), Path(out, scenario), scenario)
    store.set(f"done{rank}", "1")
    if rank == 0:  # the store lives in this process: it stays until every rank is through
        store.wait([f"done{r}" for r in range(WORLD)])
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rank": rank}))


def play(rank: int, store: dist.Store, out: Path, scenario: str) -> None:
    """One scenario on one rank: build the same model, watch the DDP wrapper, train, report what it saw."""
    out.mkdir(parents=True, exist_ok=True)
    run = str(out / "run")
    result: dict[str, Any] = {"rank": rank}
    ddp: Any = None  # kept past the scenario with its process group (ranks.leave_group)
    model: Any = None
    restore: Callable[[], None] | None = None
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT)
        torch.manual_seed(0)  # the same initial weights on both ranks
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        fsdp = scenario.startswith("fsdp")
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            for layer in (model[0], model[2]):
                fully_shard(layer)
            ddp = fully_shard(model)
        else:
            ddp = DistributedDataParallel(model)
        options: dict[str, Any] = {"console": False}
        if scenario == "divergence":
            options.update(replica_check_every=4)
        if scenario == "fsdp_last_sampled":  # sampled: steps 0 and the last, which no next step reads
            options.update(sample_every=STEPS - 1)
        if scenario == "halt":
            options.update(rules=[gw.Rule(when="nonfinite", do="halt")])
        snaps = Path(out, f"snaps{rank}")
        if scenario.startswith("rollback"):
            options.update(rules=[gw.Rule(when="nonfinite", do="rollback")], snapshot_every=2)
            if scenario == "rollback_unwritable" and rank == 1:  # its snapshot_dir cannot be made: a file is in the way
                Path(out, "blocked").write_text("a file, not a folder")
                snaps = Path(out, "blocked", "snaps")
            options.update(snapshot_dir=str(snaps))
        if scenario.startswith("fail") and rank == 1:
            restore = plant_failure(scenario)
        gw.watch(ddp, run=run, **options)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
        weights: dict[int, list[float]] = {}
        for step in range(STEPS):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            if scenario in ("nan", "halt", "rollback_unwritable", "rollback_lost", "rollback_diverged") and \
                    rank == 1 and step == 5:
                x[0, 0] = float("nan")  # poisoned on rank 1 only
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            gw.watcher(ddp).observe(loss=loss)
            if fsdp:  # the whole gradients' norms, gathered across the shards
                full = {n: float(p.grad.full_tensor().norm()) for n, p in model.named_parameters()}
                result.setdefault("full_norms", {})[str(step)] = full
                whole = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
            before = model[0].weight.detach().clone()
            try:
                opt.step()
            except gw.TrainingHalted as exc:
                result["halted_at"] = exc.step
                break
            if fsdp:  # the whole update's ratio to the whole weights
                result.setdefault("update_ratios", {})[str(step)] = {
                    n: float((p.detach().full_tensor() - whole[n]).norm() / whole[n].norm())
                    for n, p in model.named_parameters()}
            weights[step] = [float((model[0].weight.detach() - before).abs().max().full_tensor()
                                   if fsdp else (model[0].weight.detach() - before).abs().max())]
            if scenario == "rollback_lost" and rank == 1 and step == 4:
                for path in snaps.glob("snapshot-*.pt"):
                    path.unlink()  # this rank's snapshots are lost (a scratch disk wiped)
            if scenario == "rollback_diverged" and rank == 1 and step == 3:
                with torch.no_grad():
                    model[2].bias.add_(1.0)  # the replicas drift apart, with no replica check due for 100 steps
            if scenario == "divergence" and rank == 1 and step == 6:
                with torch.no_grad():
                    model[2].bias.add_(1.0)  # a rank-dependent update outside DDP
        if scenario.startswith("fail"):
            watcher = gw.watcher(ddp)
            result.update(detached=watcher.detached, watched_steps=watcher.step)
        gw.unwatch(ddp)
        result["changed"] = {str(k): v[0] for k, v in weights.items()}
        result["weight_sum"] = float(sum((p.full_tensor() if fsdp else p).detach().double().sum()
                                         for p in model.parameters()))
        dist.barrier()
    except BaseException:
        result["error"] = traceback.format_exc()
    finally:
        if restore is not None:
            restore()
        leave_group(ddp, model)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def plant_failure(scenario: str) -> Callable[[], None]:
    """A bug in gradwatch on this rank only, at step 5: inside the step (before the ranks share
    their findings) or between steps (in the optimizer's step post-hook, after they shared).
    Returns what takes it out again (the next scenario runs in the same process).
    """
    from gradwatch.judging.judge import Judge
    from gradwatch.step.recording import Recording

    warnings.simplefilter("always")
    if scenario == "fail_in_step":
        check = Judge.check

        def broken_check(self: Judge, record: Any) -> Any:
            if record.step == 5:
                raise RuntimeError("planted bug on rank 1 (in the step)")
            return check(self, record)

        Judge.check = broken_check  # type: ignore[method-assign]

        def restore() -> None:
            Judge.check = check  # type: ignore[method-assign]

        return restore
    else:
        post = Recording.step_post

        def broken_post(self: Recording, opt: Any) -> Any:
            if self.open is not None and self.open.record.step == 5:
                raise RuntimeError("planted bug on rank 1 (between steps)")
            return post(self, opt)

        Recording.step_post = broken_post  # type: ignore[method-assign]  # run by the guard, as every hook is

        def restore_post() -> None:
            Recording.step_post = post  # type: ignore[method-assign]

        return restore_post


@pytest.fixture(scope="module")
def played(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every scenario played by one pair of ranks; the folder of their results."""
    out = tmp_path_factory.mktemp("ddp")
    spawn_ranks(worker, (str(out), SCENARIOS), out, timeout=120 + 30 * len(SCENARIOS))
    return out


def launch(played: Path, scenario: str) -> tuple[Path, list[dict[str, Any]]]:
    """A scenario's run and each rank's results; fails if a rank reported an error (a collective that
    timed out included)."""
    results = [json.loads((played / scenario / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in results:
        assert "error" not in r, r["error"]
    return played / scenario / "run", results


def test_healthy_ddp_run_is_written_once_by_rank_0(played: Path) -> None:
    run, results = launch(played, "healthy")
    with gw.open_run(run) as stored:
        assert stored.steps == STEPS and stored.status == "finished"
        assert stored.meta["world_size"] == WORLD
        assert stored.findings().empty, "a healthy DDP run has no findings"
        assert len(stored.series("loss")[0]) == STEPS
    assert results[0]["weight_sum"] == pytest.approx(results[1]["weight_sum"], rel=1e-9), "replicas agree"
    assert json.loads((run / "verdict.json").read_text())["status"] == "finished"


def test_nan_on_one_rank_is_skipped_on_every_rank_at_the_same_step(played: Path) -> None:
    run, results = launch(played, "nan")
    for r in results:
        assert r["changed"]["5"] == 0.0, f"rank {r['rank']} applied the poisoned step"
        assert r["changed"]["6"] > 0.0, f"rank {r['rank']} went on training"
    assert results[0]["weight_sum"] == pytest.approx(results[1]["weight_sum"], rel=1e-9), "replicas still agree"
    with gw.open_run(run) as stored:
        found = stored.findings()
        assert stored.steps == STEPS
        assert stored.skipped_steps().tolist() == [5]
    nonfinite = found[found["kind"] == "nonfinite"]
    assert nonfinite["step"].tolist() == [5] and nonfinite["action"].tolist() == ["skip"]
    data = nonfinite["data"].iloc[0]
    assert data["ranks"] == [0, 1] and data["origin"] == "replayed", "named where it was born: rank 1's batch"
    assert nonfinite["phase"].iloc[0] == "forward" and nonfinite["message"].iloc[0].endswith("(born on rank 1 of 2)")


def test_replicas_that_drift_apart_are_found(played: Path) -> None:
    run, _ = launch(played, "divergence")
    with gw.open_run(run) as stored:
        found = stored.findings()
    diverged = found[found["kind"] == "replica_divergence"]
    assert diverged["step"].tolist()[:1] == [8], "the first check after rank 1 changed its replica (step 6)"
    assert diverged["layer"].iloc[0] == "2" and diverged["severity"].iloc[0] == "error"
    assert "differ across the 2 ranks" in diverged["message"].iloc[0]


def test_halt_decided_on_one_rank_stops_every_rank_at_the_same_step(played: Path) -> None:
    run, results = launch(played, "halt")
    assert [r.get("halted_at") for r in results] == [5, 5], "both ranks raised TrainingHalted at step 5"
    with gw.open_run(run) as stored:
        assert stored.status == "halted" and stored.steps == 6
    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["status"] == "halted" and verdict["halted"]["step"] == 5


def test_fsdp_per_parameter_norms_are_the_whole_gradients(played: Path) -> None:
    run, results = launch(played, "fsdp")
    full = results[0]["full_norms"]
    with gw.open_run(run) as stored:
        assert stored.steps == STEPS and stored.findings().empty
        per_param = stored.metrics("grad_norm", per_parameter=True, include_global=False)
        global_norm = stored.series("grad_norm")[1]
    for step in (0, 10):  # per-parameter rows are kept on sampled steps
        rows = per_param[(per_param["step"] == step) & per_param["layer"].str.contains(".", regex=False)]
        got = dict(zip(rows["layer"], rows["value"]))
        assert got.keys() == full[str(step)].keys()
        for name, value in full[str(step)].items():
            assert got[name] == pytest.approx(value, rel=1e-5), (step, name)
    for step in range(STEPS):  # the global norm of every step is the whole model's
        expected = sum(v ** 2 for v in full[str(step)].values()) ** 0.5
        assert global_norm[step] == pytest.approx(expected, rel=1e-5), step


def test_fsdp_update_ratios_are_the_whole_models_or_left_out_at_the_last_step(played: Path) -> None:
    """A sampled step's update norms are read with the next step's, combined across the shards;
    the last step's have no next step, and one rank alone cannot combine them: left out, not a
    shard's ratio."""
    run, results = launch(played, "fsdp_last_sampled")
    whole = results[0]["update_ratios"]
    with gw.open_run(run) as stored:
        assert stored.steps == STEPS and stored.findings().empty
        ratios = stored.metrics("update_ratio", per_parameter=True, include_global=False)
        last = next(r for r in stored.records() if r.step == STEPS - 1)
    rows = ratios[ratios["layer"].str.contains(".", regex=False)]
    first = rows[rows["step"] == 0]
    assert dict(zip(first["layer"], first["value"])) == pytest.approx(whole["0"], rel=1e-4)
    assert last.sampled and last.vector("param_norm") is not None
    assert last.vector("update_ratio") is None


@pytest.mark.parametrize(("scenario", "left_at"), [("fail_in_step", 5), ("fail_between_steps", 6)])
def test_gradwatch_failing_on_one_rank_stops_it_on_every_rank_at_the_same_step(
        played: Path, scenario: str, left_at: int) -> None:
    run, results = launch(played, scenario)  # no rank hangs in a collective (launch asserts it)
    for r in results:
        assert len(r["changed"]) == STEPS, f"rank {r['rank']} stopped training"
        assert r["detached"] is True, f"rank {r['rank']} still watches"
        assert r["watched_steps"] == left_at + 1, (r["rank"], r["watched_steps"])
    assert results[0]["weight_sum"] == pytest.approx(results[1]["weight_sum"], rel=1e-9)  # DDP stayed in sync
    with gw.open_run(run) as opened:
        assert opened.status == "crashed"
        assert opened.steps == left_at


def test_a_rollback_one_rank_cannot_do_is_a_skip_on_every_rank(played: Path) -> None:
    """Rank 1 could keep no snapshot (its snapshot_dir is unwritable): both ranks skip, and say why."""
    run, results = launch(played, "rollback_unwritable")
    for r in results:
        assert r["changed"]["5"] == 0.0, f"rank {r['rank']} applied the poisoned step"
        assert r["changed"]["6"] > 0.0, f"rank {r['rank']} went on training"
    assert results[0]["weight_sum"] == results[1]["weight_sum"], "the replicas are still one model"
    assert sorted(p.name for p in (played / "rollback_unwritable" / "snaps0").glob("*.pt")), "rank 0 kept its snapshots"
    with gw.open_run(run) as stored:
        found = stored.findings()
        assert stored.skipped_steps().tolist() == [5]
    nonfinite = found[found["kind"] == "nonfinite"]
    assert nonfinite["step"].tolist() == [5] and nonfinite["action"].tolist() == ["rollback"]
    outcome = nonfinite["data"].iloc[0]["outcome"]
    assert outcome["rolled_back"] is False and outcome["ranks_without_snapshot"] == [1]
    assert outcome["reason"] == "rank 1 of 2 could not keep a snapshot; every rank skipped the step instead"
    assert "replica_divergence" not in set(found["kind"]), "checked at the step after the rollback: one model"


def test_a_rollback_to_a_snapshot_lost_on_one_rank_halts_every_rank(played: Path) -> None:
    run, results = launch(played, "rollback_lost")
    assert [r.get("halted_at") for r in results] == [5, 5], "both ranks raised TrainingHalted at step 5"
    assert results[0]["weight_sum"] == results[1]["weight_sum"], "neither rank restored a snapshot alone"
    with gw.open_run(run) as stored:
        assert stored.status == "halted"
    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["halted"]["step"] == 5 and "no intact snapshot" in verdict["halted"]["reason"]
    assert "not intact on every rank" in verdict["halted"]["reason"]


def test_the_replicas_are_compared_at_the_step_after_a_rollback(played: Path) -> None:
    run, _ = launch(played, "rollback_diverged")
    with gw.open_run(run) as stored:
        found = stored.findings()
    assert found[found["kind"] == "nonfinite"]["action"].tolist() == ["rollback"]
    diverged = found[found["kind"] == "replica_divergence"]
    assert diverged["step"].tolist() == [6] and diverged["layer"].iloc[0] == "2"
