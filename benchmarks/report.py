"""Report benchmark: generation time and file size of ``gradwatch report`` on a large run.

Builds a synthetic run shaped like a real watcher's (the store benchmark's records: per-layer and
per-parameter gradient statistics every step, the costlier ones every ``--sample-every`` steps)
with a few planted findings, then times the report and prints its size.

    python benchmarks/report.py --layers 1000 --steps 100000            # builds the run in a temp dir
    python benchmarks/report.py --layers 1000 --steps 100000 --keep /tmp/big   # keep it for reuse
    python benchmarks/report.py --run /tmp/big                          # time the report of an existing run
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from store import synthetic_layout, synthetic_record  # noqa: E402

from gradwatch.store import StoreWriter, create_store  # noqa: E402
from gradwatch.store.findings import Finding  # noqa: E402


def build_run(path: Path, layers: int, steps: int, sample_every: int, batch: int = 512) -> float:
    """Write a synthetic run with planted findings; returns the seconds it took."""
    start = time.perf_counter()
    layout = synthetic_layout(layers)
    rng = np.random.default_rng(0)
    db = create_store(path, {"model": "Synthetic", "parameters": 4096 * layers}, overwrite=True)
    writer = StoreWriter(db)
    for first in range(0, steps, batch):
        writer.write([synthetic_record(layout, s, rng, sample_every) for s in range(first, min(first + batch, steps))])
    planted = [
        Finding("exploding", "warning", steps // 3, layout.layers[layers // 2], "planted explosion",
                value=1e3, action="clip", data={"hint": "clip gradients"}, id=1),
        Finding("nonfinite", "error", steps // 2, layout.layers[1], "planted NaN", phase="forward",
                action="skip", data={"origin": "replayed", "hint": "guard the op"}, id=2),
        Finding("vanishing", "warning", 2 * steps // 3, layout.layers[0], "planted vanishing",
                value=1e-9, action="warn", data={"repeats": 40}, id=3),
    ]
    writer.write_findings(planted)
    writer.close("finished")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--sample-every", type=int, default=10)
    parser.add_argument("--run", type=Path, help="time the report of this existing run instead of building one")
    parser.add_argument("--keep", type=Path, help="build the synthetic run here and keep it")
    args = parser.parse_args()

    from gradwatch.report import write as write_report

    console = Console()
    tmp = None
    build_s = None
    if args.run is not None:
        run_dir = args.run
    else:
        run_dir = args.keep or Path(tempfile.mkdtemp(prefix="gradwatch-report-bench-")) / "run"
        tmp = None if args.keep else run_dir.parent
        with console.status(f"building a {args.layers} x {args.steps} run ..."):
            build_s = build_run(run_dir, args.layers, args.steps, args.sample_every)
    try:
        out = run_dir / "report.html"
        start = time.perf_counter()
        write_report(run_dir, out)
        seconds = time.perf_counter() - start
        table = Table(title=f"gradwatch report of {run_dir}")
        table.add_column("what")
        table.add_column("figure", justify="right")
        if build_s is not None:
            table.add_row("synthetic run built in", f"{build_s:.0f} s ({args.layers} layers x {args.steps} steps)")
        table.add_row("store size", f"{(run_dir / 'gradwatch.sqlite').stat().st_size / 2**20:.0f} MiB")
        table.add_row("report generation", f"{seconds:.1f} s")
        table.add_row("report size", f"{out.stat().st_size / 2**20:.2f} MiB")
        console.print(table)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
