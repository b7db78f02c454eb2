"""The live dashboard over HTTP: httpx against the ASGI app, a real uvicorn server for the event stream."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient

import gradwatch as gw
from gradwatch.dashboards import data
from gradwatch.dashboards.server import create_app, start
from gradwatch.store import downsample
from gradwatch.store.schema import DB_NAME
from tests.test_report import BIG_STEP, NAN_STEP, XSS_LAYER, XSS_RUN, loop, make_model, synthetic, train

XSS_ID = "/".join(XSS_RUN)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of runs: one in trouble, a healthy one under a hostile name, a nested one, a long one."""
    root = tmp_path_factory.mktemp("dashboard-root")
    train(root / "trouble", nan_step=NAN_STEP, big_step=BIG_STEP)
    train(root.joinpath(*XSS_RUN), steps=30, odd_layer=True)
    train(root / "team" / "nested", steps=12)
    synthetic(root / "long", layers=260, steps=2500, spike=(1777, 123))
    (root / "not-a-run").mkdir()
    (root / "not-a-run" / "notes.txt").write_text("hello")
    return root


@pytest.fixture(scope="module")
def client(root: Path) -> TestClient:
    return TestClient(create_app(root), base_url="http://127.0.0.1")


def get(client: TestClient, path: str, **params: Any) -> Any:
    response = client.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


# ------------------------------------------------------------------ the runs list
def test_runs_list_every_run_with_status_steps_and_counts(client: TestClient) -> None:
    rows = {row["id"]: row for row in get(client, "/api/runs")}
    assert set(rows) == {"trouble", XSS_ID, "team/nested", "long"}
    trouble = rows["trouble"]
    assert trouble["steps"] == 50 and trouble["status"] == "finished" and trouble["worst"] == "error"
    assert trouble["findings"]["error"] >= 1
    assert rows["team/nested"]["steps"] == 12 and rows["team/nested"]["worst"] is None
    assert all(isinstance(r["updated"], float) and r["updated"] > 0 for r in rows.values())


# ------------------------------------------------------------------ one run, against its store
def test_summary_matches_the_store(client: TestClient, root: Path) -> None:
    summary = get(client, "/api/run/summary", run="trouble")
    with gw.open_run(root / "trouble") as run:
        found = run.findings()
        assert summary["steps"] == run.steps and summary["last_step"] == run.steps - 1
        assert summary["status"] == "finished" and summary["state"] == "errors"
        assert summary["counts"]["error"] == int((found["severity"] == "error").sum())
        assert [layer["name"] for layer in summary["layers"]] == run.layers
    assert "nonfinite" in summary["headline"] and dict(summary["facts"])["steps"] == "50"


def test_curves_are_the_stored_series(client: TestClient, root: Path) -> None:
    curves = get(client, "/api/run/curves", run="trouble")
    with gw.open_run(root / "trouble") as run:
        for name in ("grad_norm", "loss"):
            steps, values = run.series(name)
            assert curves["curves"][name]["steps"] == steps.tolist()
            shown = np.array([np.nan if v is None else v for v in curves["curves"][name]["values"]])
            np.testing.assert_allclose(shown, values, rtol=1e-5)
        assert curves["skipped"] == run.skipped_steps().tolist() == [NAN_STEP]
    zoomed = get(client, "/api/run/curves", run="trouble", start=20, stop=30)
    assert zoomed["curves"]["loss"]["steps"] == list(range(20, 30))


def test_findings_match_the_store_with_remedies(client: TestClient, root: Path) -> None:
    listed = get(client, "/api/run/findings", run="trouble")
    with gw.open_run(root / "trouble") as run:
        stored = run.findings()
    assert listed["total"] == len(stored)
    assert sorted((f["kind"], f["step"], f["layer"]) for f in listed["findings"]) == sorted(
        (k, int(s), la if isinstance(la, str) else None) for k, s, la in zip(stored["kind"], stored["step"],
                                                                            stored["layer"]))
    nonfinite = next(f for f in listed["findings"] if f["kind"] == "nonfinite")
    assert nonfinite["step"] == NAN_STEP and nonfinite["layer"] == "features" and nonfinite["action"] == "skip"
    assert nonfinite["remedies"] and "skipped" in nonfinite["outcome"]
    assert listed["findings"][0]["severity"] == "error", "most severe first"


def test_flow_is_the_latest_gradient_norm_per_layer(client: TestClient, root: Path) -> None:
    flow = get(client, "/api/run/flow", run="trouble")
    with gw.open_run(root / "trouble") as run:
        last = run.matrix("grad_norm", steps=slice(49, 50))
        first = run.matrix("grad_norm", steps=slice(0, 1))
    assert flow["step"] == 49 and flow["first_step"] == 0
    assert flow["layers"] == ["hidden", "out"], "only layers with gradients, in model order"
    np.testing.assert_allclose(flow["values"], last[flow["layers"]].to_numpy()[0], rtol=1e-5)
    np.testing.assert_allclose(flow["first"], first[flow["layers"]].to_numpy()[0], rtol=1e-5)
    at = get(client, "/api/run/flow", run="trouble", step=10)
    assert at["step"] == 10


def test_heatmap_is_log10_of_the_stored_matrix(client: TestClient, root: Path) -> None:
    heat = get(client, "/api/run/heatmap", run="trouble", metric="grad_norm")
    with gw.open_run(root / "trouble") as run:
        matrix = run.matrix("grad_norm")
    assert heat["exact"] and heat["steps"] == matrix.index.tolist() and heat["layers"] == ["hidden", "out"]
    z = np.array([[np.nan if v is None else v for v in row] for row in heat["z"]])
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.log10(matrix[heat["layers"]].to_numpy().T)
    np.testing.assert_allclose(z, np.round(expected, 2), atol=0.006, equal_nan=True)
    zero = get(client, "/api/run/heatmap", run="trouble", metric="act_zero_frac")
    assert zero["log"] is False and zero["layers"], "activation metrics are shown for leaf modules"


def test_layer_detail_series(client: TestClient, root: Path) -> None:
    layer = get(client, "/api/run/layer", run="trouble", layer="hidden")
    with gw.open_run(root / "trouble") as run:
        stored = run.metrics("grad_norm", layers=["hidden"], include_global=False)
    assert layer["exact"] and layer["type"] == "Linear" and layer["params"] == 4 * 16 + 16
    series = layer["series"]["grad_norm"]
    assert series["steps"] == stored["step"].tolist()
    np.testing.assert_allclose(np.array(series["values"], dtype=float), stored["value"].to_numpy(), rtol=1e-5,
                               equal_nan=True)
    assert {"grad_norm", "update_ratio"} <= set(layer["series"])


# ------------------------------------------------------------------ bounded at scale
def test_every_response_stays_bounded_and_keeps_the_spike(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a small envelope and raw-read limit so that a 2,500-step run already needs coarse buckets
    monkeypatch.setattr(data, "RAW_STEPS", 500)
    app = create_app(root)
    app.state.dashboard.envelopes = data.Envelopes(capacity=64)
    client = TestClient(app, base_url="http://127.0.0.1")
    curves = get(client, "/api/run/curves", run="long")
    assert len(curves["curves"]["grad_norm"]["steps"]) <= data.MAX_POINTS
    assert max(v for v in curves["curves"]["grad_norm"]["values"] if v is not None) >= 1e4, "spike kept"
    for params in ({}, {"start": 1000, "stop": 2400}, {"start": 1700, "stop": 1800}):
        heat = get(client, "/api/run/heatmap", run="long", metric="grad_norm", **params)
        assert len(heat["steps"]) <= data.MAX_COLUMNS and len(heat["layers"]) <= data.MAX_ROWS
        assert len(heat["z"]) == len(heat["layers"]) and all(len(r) == len(heat["steps"]) for r in heat["z"])
        assert "blocks.123.linear" in heat["layers"], "the layer with a finding is kept"
        assert max(v for r in heat["z"] for v in r if v is not None) == pytest.approx(4.0), "spike kept"
    whole = get(client, "/api/run/heatmap", run="long", metric="grad_norm")
    assert not whole["exact"] and "Showing 200 of 260 layers" in whole["note"]
    assert get(client, "/api/run/heatmap", run="long", metric="grad_norm", start=1700, stop=1800)["exact"]
    layer = get(client, "/api/run/layer", run="long", layer="blocks.123.linear")
    assert not layer["exact"] and len(layer["series"]["grad_norm"]["steps"]) <= 64
    assert max(layer["series"]["grad_norm"]["high"]) == pytest.approx(1e4), "spike kept in the envelope"
    assert min(layer["series"]["grad_norm"]["low"]) > 0
    flow = get(client, "/api/run/flow", run="long")
    assert len(flow["layers"]) == 260


def test_envelopes_follow_a_growing_run(tmp_path: Path) -> None:
    """Vectors written after the envelope was built are folded in; nothing is read twice needlessly."""
    path = tmp_path / "growing"
    model = gw.watch(make_model(), run=path, console=False, tensorboard=False)
    loop(model, 20)
    gw.watcher(model).flush()
    cache, curves = data.Envelopes(capacity=8), data.Curves()
    with gw.open_run(path) as run:
        first = cache.get(run, "grad_norm")
        assert first.envelope.last == run.progress()["last_step"] >= 18
        assert curves.get(run, "loss")[0].tolist() == run.series("loss")[0].tolist()
    loop(model, 30)  # 30 more steps: the envelope must double its buckets twice
    gw.unwatch(model)
    with gw.open_run(path) as run:
        entry = cache.get(run, "grad_norm")
        steps, low, high = entry.envelope.view()
        matrix = run.matrix("grad_norm")
        for name in ("loss", "grad_norm"):  # the series grown piecewise is the series read whole
            grown, whole = curves.get(run, name), run.series(name)
            assert grown[0].tolist() == whole[0].tolist() == list(range(50))
            np.testing.assert_array_equal(grown[1], whole[1])
    assert entry is first and entry.envelope.last == 49 and entry.envelope.scale == 8
    expected = downsample.Envelope(len(matrix.columns), 8)
    expected.add(matrix.index.to_numpy(), matrix.to_numpy())
    np.testing.assert_array_equal(high, expected.view()[2])
    np.testing.assert_array_equal(low, expected.view()[1])


# ------------------------------------------------------------------ safety
@pytest.mark.parametrize("name", ["../etc", "../../etc/passwd", "/etc/passwd", "..", "team/../../x", "not-a-run",
                                  "team", "a\\b", "trouble\x00", "", "outside-link"])
def test_runs_outside_the_root_or_not_runs_are_404(client: TestClient, root: Path, tmp_path_factory, name: str) -> None:
    if name == "outside-link" and not (root / name).exists():
        outside = tmp_path_factory.mktemp("outside")
        train(outside / "secret", steps=3)
        (root / name).symlink_to(outside / "secret", target_is_directory=True)
    for path in ("/api/run/summary", "/api/run/curves", "/api/run/heatmap", "/api/events"):
        response = client.get(path, params={"run": name})
        assert response.status_code in ((400,) if name == "" and path != "/api/events" else (404,)), (path, name)
    if name:
        page = client.get("/run", params={"run": name})
        assert page.status_code == 404 and "No such run" in page.text


def test_names_are_escaped_in_pages(client: TestClient) -> None:
    page = client.get("/run", params={"run": XSS_ID})
    assert page.status_code == 200
    assert "<script>alert(1)</script>" not in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    boot = re.search(r'<script id="boot" type="application/json">(.*?)</script>', page.text, re.S)
    assert boot is not None and json.loads(boot.group(1)) == {"page": "run", "run": XSS_ID}
    assert "<" not in boot.group(1)
    compare = client.get("/compare", params={"run": [XSS_ID, "trouble"]})
    assert compare.status_code == 200 and "<script>alert(1)</script>" not in compare.text
    # JSON carries the names as data; the page puts them in with textContent (see the browser test)
    summary = get(client, "/api/run/summary", run=XSS_ID)
    assert XSS_LAYER in [layer["name"] for layer in summary["layers"]]


def test_nothing_writes(client: TestClient, root: Path) -> None:
    before = {p: digest(p) for p in (root / "trouble", root / "long")}
    for path in ("/api/runs", "/api/run/summary", "/api/run/findings", "/api/run/heatmap", "/", "/run"):
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            assert client.request(method, path, params={"run": "trouble"}).status_code == 405, (method, path)
    for path in ("/api/run/summary", "/api/run/curves", "/api/run/findings", "/api/run/flow", "/api/run/heatmap",
                 "/api/run/progress"):
        get(client, path, run="trouble")
        get(client, path, run="long")
    assert {p: digest(p) for p in before} == before


def test_bad_parameters_are_clear_400s(client: TestClient) -> None:
    cases = [
        ({"run": "trouble", "metric": "nope"}, "/api/run/heatmap",
         "unknown metric 'nope'; valid metrics are: grad_norm"),
        ({"run": "trouble", "start": "-1"}, "/api/run/curves", "start must be between 0"),
        ({"run": "trouble", "start": "ten"}, "/api/run/curves", "start must be a whole number, got 'ten'"),
        ({"run": "trouble", "start": "30", "stop": "20"}, "/api/run/heatmap", "is empty"),
        ({}, "/api/run/summary", "the 'run' parameter is required"),
        ({"run": "trouble"}, "/api/run/layer", "the 'layer' parameter is required"),
    ]
    for params, path, message in cases:
        response = client.get(path, params=params)
        assert response.status_code == 400 and message in response.json()["error"], (path, response.text)
    missing = client.get("/api/run/layer", params={"run": "trouble", "layer": "nope"})
    assert missing.status_code == 404


def test_corrupted_run_is_reported_not_crashed(tmp_path: Path) -> None:
    train(tmp_path / "good", steps=5)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / DB_NAME).write_bytes(b"SQLite format 3\x00" + b"\x00" * 200)
    client = TestClient(create_app(tmp_path), base_url="http://127.0.0.1")
    rows = {r["id"]: r for r in get(client, "/api/runs")}
    assert rows["bad"]["status"] == "damaged" and "corrupted" in rows["bad"]["error"]
    response = client.get("/api/run/summary", params={"run": "bad"})
    assert response.status_code == 422 and "corrupted" in response.json()["error"]


def test_safe_headers_and_host_check(client: TestClient) -> None:
    page = client.get("/")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["x-frame-options"] == "DENY"
    assert client.get("/api/runs", headers={"host": "attacker.example"}).status_code == 400, "DNS rebinding"
    assert client.get("/static/../server.py").status_code == 404
    assert client.get("/static/plotly.min.js").headers["content-type"].startswith("text/javascript")


# ------------------------------------------------------------------ server push, on a real server
def events(url: str, stop: threading.Event, out: list[tuple[str, dict[str, Any]]]) -> None:
    with httpx.Client(timeout=httpx.Timeout(5.0, read=30.0)) as client, client.stream("GET", url) as response:
        # the stream ends when the server stops (a clean end of the chunked body, not a broken connection)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if stop.is_set():
                return
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and name:
                out.append((name, json.loads(line[6:])))


def wait_for(check: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_progress_and_new_runs_are_pushed_live(tmp_path: Path) -> None:
    model = gw.watch(make_model(), run=tmp_path / "live", console=False, tensorboard=False, flush_seconds=0.1)
    loop(model, 3)
    gw.watcher(model).flush()
    with start(tmp_path, poll=0.1) as dash:
        stop = threading.Event()
        progress: list[tuple[str, dict[str, Any]]] = []
        runs: list[tuple[str, dict[str, Any]]] = []
        threads = [threading.Thread(target=events, args=(f"{dash.url}api/events?run=live", stop, progress),
                                    daemon=True),
                   threading.Thread(target=events, args=(f"{dash.url}api/events", stop, runs), daemon=True)]
        for t in threads:
            t.start()
        wait_for(lambda: progress and runs)
        assert progress[0][0] == "progress" and progress[0][1]["status"] == "running"
        assert progress[0][1]["steps"] >= 2  # the newest step is written once the next one starts (or at close)
        assert runs[0][0] == "runs" and [r["id"] for r in runs[0][1]] == ["live"]
        loop(model, 4)  # training goes on: the stream says so without being asked
        gw.watcher(model).flush()
        wait_for(lambda: progress[-1][1]["steps"] >= 6)
        train(tmp_path / "second", steps=2)  # a new run appears in the list
        wait_for(lambda: "second" in [r["id"] for r in runs[-1][1]])
        gw.unwatch(model)
        wait_for(lambda: progress[-1][1]["status"] == "finished" and progress[-1][1]["steps"] == 7)
        stop.set()


# ------------------------------------------------------------------ command line
def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gradwatch", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    missing = cli("dashboard", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such folder" in missing.stderr and "Traceback" not in missing.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = cli("dashboard", str(tmp_path), "--port", str(busy.getsockname()[1]))
    assert taken.returncode == 2 and "Traceback" not in taken.stderr
    assert taken.stderr.startswith("gradwatch: error: cannot listen on 127.0.0.1:") and "--port" in taken.stderr
    assert len(taken.stderr.strip().splitlines()) == 1


def test_cli_serves_and_prints_the_url(root: Path) -> None:
    process = subprocess.Popen([sys.executable, "-m", "gradwatch", "dashboard", str(root), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        assert found, line
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.get(found.group(1) + "api/runs", timeout=5)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert response.status_code == 200 and "trouble" in {r["id"] for r in response.json()}
        # Ctrl-C with a live page open: the stream ends and the server stops promptly, quietly
        stop, seen = threading.Event(), []  # type: ignore[var-annotated]
        watcher = threading.Thread(target=events, args=(found.group(1) + "api/events?run=trouble", stop, seen),
                                   daemon=True)
        watcher.start()
        wait_for(lambda: seen)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=10)
        watcher.join(timeout=10)
        assert not watcher.is_alive()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    assert process.stderr is not None and "Traceback" not in process.stderr.read()
