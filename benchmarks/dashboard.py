"""Dashboard benchmark: latency and size of the live dashboard's JSON endpoints on a large run.

Builds the report benchmark's synthetic run (or uses an existing one), serves it with the dashboard's
app in-process (httpx over ASGI, gzip accepted, as a browser asks) and calls each JSON endpoint a
run page makes: once cold (the heatmap and layer views build their per-(run, metric) envelope on
first use) and ``--repeat`` times warm (the median is shown). Prints latency, bytes on the wire
(compressed) and decoded, and whether the response stays within the dashboard's bounds (a curve or
series at most 2,000 points, a heatmap at most 400 columns x 200 rows); exits non-zero when a bound
or a status fails.

    python benchmarks/dashboard.py --layers 1000 --steps 100000                # builds the run in a temp dir
    python benchmarks/dashboard.py --layers 1000 --steps 100000 --keep /tmp/runs/big   # keep it for reuse
    python benchmarks/dashboard.py --run /tmp/runs/big                         # an existing run

With ``--run DIR`` (and ``--keep DIR``) the folder served is DIR's parent, so ``/api/runs`` also
lists (and its time includes) every other run beside DIR: give it a folder of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import build_run  # noqa: E402

#: the bounds the dashboard promises, whatever the run's length
MAX_POINTS = 2000
MAX_COLUMNS, MAX_ROWS = 400, 200
BASE_URL = "http://127.0.0.1"

Check = Callable[[Any], tuple[bool, str]]


# ------------------------------------------------------------------ bound checks (ok, what was found)
def _series_ok(series: dict[str, Any]) -> tuple[bool, int]:
    """One curve / series: its arrays of one length, at most ``MAX_POINTS``."""
    lengths = {len(v) for k, v in series.items() if k in ("steps", "values", "low", "high")}
    longest = max(lengths, default=0)
    return len(lengths) <= 1 and longest <= MAX_POINTS, longest


def check_curves(body: Any) -> tuple[bool, str]:
    from gradwatch.dashboards.data import MAX_SKIPPED

    found = [_series_ok(c) for c in body["curves"].values()]
    ok = all(f[0] for f in found) and len(body["skipped"]) <= MAX_SKIPPED
    return ok, f"{len(found)} curves ≤{max((f[1] for f in found), default=0):,} pts"


def check_layer(body: Any) -> tuple[bool, str]:
    found = [_series_ok(s) for s in body["series"].values()]
    kind = "exact" if body["exact"] else "envelope"
    return all(f[0] for f in found), f"{len(found)} series ({kind}) ≤{max((f[1] for f in found), default=0):,} pts"


def check_heatmap(body: Any) -> tuple[bool, str]:
    columns, rows = len(body["steps"]), len(body["layers"])
    ok = len(body["z"]) == rows and all(len(r) == columns for r in body["z"])
    ok = ok and columns <= MAX_COLUMNS and rows <= MAX_ROWS
    return ok, f"{columns} x {rows}{' exact' if body['exact'] else ''}"


def check_findings(body: Any) -> tuple[bool, str]:
    from gradwatch.dashboards.data import MAX_FINDINGS

    return len(body["findings"]) <= MAX_FINDINGS, f"{len(body['findings'])} of {body['total']}"


def check_flow(body: Any) -> tuple[bool, str]:
    n = len(body["layers"])
    return len(body["values"]) == n and len(body["first"]) == n, f"{n} layers"


def unbounded(body: Any) -> tuple[bool, str]:
    return True, "n/a"


# ------------------------------------------------------------------ measuring
@dataclass
class Probe:
    label: str
    path: str
    params: dict[str, Any]
    check: Check = unbounded
    cold_s: float = 0.0
    warm_s: list[float] = field(default_factory=list)
    wire: int = 0
    size: int = 0
    encoding: str = ""
    ok: bool = True
    detail: str = ""
    errors: list[str] = field(default_factory=list)


async def call(client: Any, probe: Probe) -> float:
    """One request: its seconds; sizes, status and bounds recorded on ``probe``."""
    start = time.perf_counter()
    response = await client.get(probe.path, params=probe.params)
    seconds = time.perf_counter() - start
    probe.wire = response.num_bytes_downloaded  # what came over the wire, before gzip is undone
    probe.size = len(response.content)
    probe.encoding = response.headers.get("content-encoding", "identity")
    if response.status_code != 200:
        probe.ok = False
        probe.detail = f"HTTP {response.status_code}"
        probe.errors.append(f"{probe.label}: HTTP {response.status_code} {response.text[:300]}")
        return seconds
    try:
        ok, detail = probe.check(json.loads(response.content))
    except (KeyError, TypeError, ValueError) as exc:
        ok, detail = False, f"malformed: {exc!r}"
    probe.ok = probe.ok and ok
    probe.detail = detail
    return seconds


async def measure(client: Any, probe: Probe, repeat: int) -> Probe:
    probe.cold_s = await call(client, probe)
    for _ in range(repeat):
        probe.warm_s.append(await call(client, probe))
    return probe


async def bench(root: Path, run_id: str, repeat: int) -> tuple[list[Probe], dict[str, Any]]:
    import httpx

    from gradwatch.dashboards.server import create_app

    app = create_app(root, host="127.0.0.1")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=BASE_URL,
                                 headers={"accept-encoding": "gzip"}) as client:
        # the run's shape, for the zoom ranges (not timed: the summary probe below is its first timed call)
        shape = await client.get("/api/run/progress", params={"run": run_id})
        if shape.status_code != 200:
            raise SystemExit(f"cannot read run {run_id!r} under {root}: HTTP {shape.status_code} {shape.text}")
        progress = shape.json()
        last = progress["last_step"] or 0
        end = last + 1
        mid = end // 2

        def around(width: int) -> dict[str, int]:
            lo = max(0, mid - width // 2)
            return {"start": lo, "stop": min(end, lo + width)}

        run = {"run": run_id}
        summary = Probe("summary", "/api/run/summary", run)
        probes = [await measure(client, summary, repeat)]
        layers = [entry["name"] for entry in (await client.get(summary.path, params=run)).json()["layers"]]
        middle = layers[len(layers) // 2] if layers else ""
        thirty = {"start": int(0.35 * end), "stop": max(int(0.65 * end), int(0.35 * end) + 1)}
        plan = [
            Probe("curves", "/api/run/curves", run, check_curves),
            Probe("curves zoom 1,000 steps", "/api/run/curves", {**run, **around(1000)}, check_curves),
            Probe("findings", "/api/run/findings", run, check_findings),
            Probe("flow", "/api/run/flow", run, check_flow),
            Probe("heatmap grad_norm", "/api/run/heatmap", {**run, "metric": "grad_norm"}, check_heatmap),
            Probe("heatmap grad_norm zoom 30%", "/api/run/heatmap", {**run, "metric": "grad_norm", **thirty},
                  check_heatmap),
            Probe("heatmap grad_norm zoom 2,000 steps", "/api/run/heatmap",
                  {**run, "metric": "grad_norm", **around(2000)}, check_heatmap),
            Probe("heatmap act_norm", "/api/run/heatmap", {**run, "metric": "act_norm"}, check_heatmap),
            Probe(f"layer {middle}", "/api/run/layer", {**run, "layer": middle}, check_layer),
            Probe(f"layer {middle} zoom 2,000 steps", "/api/run/layer", {**run, "layer": middle, **around(2000)},
                  check_layer),
            Probe("progress", "/api/run/progress", run),
            Probe("runs", "/api/runs", {}),
        ]
        for probe in plan:
            probes.append(await measure(client, probe, repeat))
    return probes, {"layers": len(layers), "middle": middle, **progress}


def peak_rss_mib() -> float | None:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--sample-every", type=int, default=10)
    parser.add_argument("--run", type=Path, help="serve this existing run (its parent folder) instead of building one")
    parser.add_argument("--keep", type=Path, help="build the synthetic run here and keep it")
    parser.add_argument("--repeat", type=int, default=5, help="warm calls per endpoint (the median is shown)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")

    console = Console()
    if not console.is_terminal and console.width < 132:  # piped: a wide table rather than wrapped cells
        console = Console(width=132)
    tmp = None
    build_s = None
    if args.run is not None:
        run_dir = args.run.resolve()
    else:
        run_dir = (args.keep or Path(tempfile.mkdtemp(prefix="gradwatch-dashboard-bench-")) / "run").resolve()
        tmp = None if args.keep else run_dir.parent
        with console.status(f"building a {args.layers} x {args.steps} run ..."):
            build_s = build_run(run_dir, args.layers, args.steps, args.sample_every)
    rss_before = peak_rss_mib()
    failed = False
    try:
        with console.status("calling the endpoints ..."):
            start = time.perf_counter()
            probes, shape = asyncio.run(bench(run_dir.parent, run_dir.name, args.repeat))
            total_s = time.perf_counter() - start

        table = Table(title=f"gradwatch dashboard JSON endpoints on {run_dir}")
        table.add_column("endpoint", no_wrap=True)
        table.add_column("cold ms", justify="right")
        table.add_column(f"warm ms (x{args.repeat})", justify="right")
        table.add_column("wire KiB", justify="right")
        table.add_column("JSON KiB", justify="right")
        table.add_column("bound")
        for p in probes:
            verdict = "[green]PASS[/]" if p.ok else "[bold red]FAIL[/]"
            wire = f"{p.wire / 2**10:,.1f}" + ("" if p.encoding == "gzip" else f" ({p.encoding})")
            table.add_row(p.label, f"{p.cold_s * 1e3:,.1f}", f"{statistics.median(p.warm_s) * 1e3:,.1f}", wire,
                          f"{p.size / 2**10:,.1f}", f"{verdict} {p.detail}")
            failed = failed or not p.ok
        console.print(table)

        facts = Table(title="run shape", show_header=False)
        facts.add_column("what")
        facts.add_column("figure", justify="right")
        if build_s is not None:
            facts.add_row("synthetic run built in", f"{build_s:.1f} s (sample every {args.sample_every} steps)")
        facts.add_row("layers x steps", f"{shape['layers']:,} x {shape['steps']:,} (last step {shape['last_step']})")
        facts.add_row("findings", f"{shape['findings']:,}")
        facts.add_row("store size", f"{(run_dir / 'gradwatch.sqlite').stat().st_size / 2**20:,.1f} MiB")
        facts.add_row("root served / run id", f"{run_dir.parent} / {run_dir.name}")
        facts.add_row("all calls", f"{total_s:.1f} s")
        rss = peak_rss_mib()
        if rss is not None:
            facts.add_row("peak RSS", f"{rss:,.0f} MiB (before serving: {rss_before:,.0f} MiB)")
        console.print(facts)
        for p in probes:
            for error in dict.fromkeys(p.errors):
                console.print(f"[red]{error}[/]")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if failed:
        console.print("[bold red]a response failed its status or its bound[/]")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
