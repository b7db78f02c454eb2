"""The overhead benchmark's attribution still reaches gradwatch's entry points (a smoke run, no timing claims)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from rich.console import Console

from gradwatch import lifecycle, probe

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
