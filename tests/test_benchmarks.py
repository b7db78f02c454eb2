"""The overhead benchmark's attribution still reaches gradwatch's entry points (a smoke run, no timing claims)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from rich.console import Console

from gradwatch.step import lifecycle, probe

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"


def load_overhead():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gradwatch_overhead_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # runs the benchmark
def test_attribution_times_every_part_and_puts_the_hooks_back(tmp_path: Path) -> None:
    overhead = load_overhead()
    before = {name: probe.Probe.__dict__[name] for name in ("_forward_pre", "_activation", "_sentinel_grad")}
    step_pre = lifecycle.Lifecycle.__dict__["step_pre"]
    row = overhead.attribute("mlp", overhead.WORKLOADS["mlp"], 20, tmp_path, Console(quiet=True))
    parts = row["ms_per_step"]
    assert row["bare_ms_per_step"] > 0
    assert parts["gradwatch (training thread)"] > parts["detectors, rules and actions"] > 0
    assert parts["origin tracking"] > 0
    assert parts["statistics (hooks, reductions, the host read, records)"] > 0
    assert parts["writer thread (CPU)"] >= 0
    assert {name: probe.Probe.__dict__[name] for name in before} == before
    assert lifecycle.Lifecycle.__dict__["step_pre"] is step_pre


@pytest.mark.slow  # runs the benchmark, and three child processes for the memory peaks
def test_the_rollout_workload_and_the_memory_peaks_are_measured(tmp_path: Path) -> None:
    overhead = load_overhead()
    out = tmp_path / "bench.json"
    overhead.main(["--workloads", "pg", "--variants", "gradwatch", "--rounds", "1", "--steps", "10", "--memory",
                   "--memory-steps", "2", "--threads", "1", "--json", str(out)])
    report = __import__("json").loads(out.read_text())
    variants = {r["variant"]: r for r in report["results"] if r["workload"] == "pg"}
    assert set(variants) == {"bare", "gradwatch"}
    assert report["unhealthy_runs"] == []  # the rollout trains healthily under the default rules
    (memory,) = report["memory"]
    assert memory["workload"] == "pg"
    peaks = memory["peaks"]
    assert set(peaks) == {"bare", "gradwatch", "gradwatch_rollback"}
    assert all(p["peak_rss"] > 0 for p in peaks.values())
    assert memory["gradwatch_rss_overhead"] == peaks["gradwatch"]["peak_rss"] - peaks["bare"]["peak_rss"]


def test_the_minimal_reference_takes_the_default_statistics_and_nothing_else() -> None:
    """``minimal``, the floor the targets are set against, reads what gradwatch's default reads:
    every step the gradient norms; every tenth also the largest values, the weight norms, the
    update norms and each leaf call's output norm and non-zero count, its hooks in place then only.
    """
    load_overhead()  # puts the benchmark's modules on the path
    import torch
    import variants
    import workloads

    mlp = workloads.WORKLOADS["mlp"]
    loop = variants.make_loop(mlp, mlp.batches()[:2])
    reference = variants.Minimal(loop)
    leaves = reference.leaves
    hooked: list[int] = []
    lr = loop.optimizer.param_groups[0]["lr"]
    P, L = len(reference.params), len(leaves)
    grads_before_step: list[torch.Tensor] = []
    loop.on_backward = lambda: grads_before_step.extend(p.grad.clone() for p in reference.params)
    for step in range(12):
        hooked.append(sum(len(m._forward_hooks) for m in leaves))
        grads_before_step.clear()
        loop.step()
        if step % 10 == 0:  # sampled: grad norms, largest values, weights, updates, then two per leaf call
            norms = torch.stack([g.norm() for g in grads_before_step])
            assert torch.allclose(reference.last[:P], norms)
            assert torch.allclose(reference.last[P:2 * P], torch.stack([g.abs().max() for g in grads_before_step]))
            # plain SGD: the update is the learning rate times the gradient
            assert torch.allclose(reference.last[3 * P:4 * P], lr * norms, rtol=1e-3)
    assert reference.sizes == [4 * P + 2 * L] + [P] * 9 + [4 * P + 2 * L] + [P]
    assert hooked == [L] + [0] * 9 + [L] + [0]
    reference.close()
    assert sum(len(m._forward_hooks) for m in leaves) == 0


@pytest.mark.slow  # trains a watched loop
def test_the_cold_parts_run_twice_give_gradwatch_the_first_result_and_are_put_back(tmp_path: Path) -> None:
    """``--cold``: each part runs where gradwatch runs it and again at once; gradwatch gets the first
    call's result (the run stays healthy and finishes), and the parts are put back afterwards."""
    overhead = load_overhead()
    import measuring

    before = [owner.__dict__[attr] for _, owner, attr in measuring.COLD_PARTS]
    row = overhead.cold("mlp", overhead.WORKLOADS["mlp"], 12, tmp_path, Console(quiet=True))
    assert [owner.__dict__[attr] for _, owner, attr in measuring.COLD_PARTS] == before
    assert set(row["parts"]) == {label for label, _, _ in measuring.COLD_PARTS}
    for part in row["parts"].values():
        assert part["calls_per_step"] == 1.0  # one per step of the MLP: its one host read, one captured call
        assert part["first_us"] > 0 and part["again_us"] > 0
    import gradwatch as gw

    with gw.open_run(tmp_path / "mlp-cold") as run:
        assert run.status == "finished" and run.steps >= 12
        assert not [f for f in run.findings().to_dict("records") if f["severity"] != "info"]
