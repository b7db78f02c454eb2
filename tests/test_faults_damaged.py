"""Damaged stores: every read path validates what it decodes; a damaged run is reported as damaged and
never stops the other runs from being listed, checked or served (issue 16, item 5).

A real run is recorded once; each test copies its store and damages the copy: hand-picked damage
from the fault campaign, then a hypothesis fuzzer of column values, bit flips and truncation (run in
the tests' pool, ``tests/pool.py``, beside the module's other tests, as the module begins).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from torch import nn

import gradwatch as gw
from gradwatch.cli.check import judge_run
from gradwatch.dashboards.server import create_app
from gradwatch.errors import DamagedStoreError
from gradwatch.report import render
from gradwatch.store.listing import describe_run
from gradwatch.store.schema import DB_NAME

from . import pool

STATUSES = {"running", "finished", "halted", "crashed", "unknown", "damaged", "unreadable"}


def train(path: Path, steps: int = 40, nan_step: int = 25, big_step: int = 32) -> None:
    """A deep narrow regression (20 layers: its all-zero vectors are stored compressed), with a NaN
    input at ``nan_step`` and targets x1000 at ``big_step``."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [m for _ in range(9) for m in (nn.Linear(8, 8), nn.Tanh())]
    model = gw.watch(nn.Sequential(*layers, nn.Linear(8, 1)), run=path, console=False, tensorboard=False,
                     detectors={"exploding": {"warmup": 10}})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, w = torch.randn(256, 8), torch.randn(8, 1)
    for step in range(steps):
        xb = x[(torch.arange(32) + step * 7) % 256].clone()
        yb = xb @ w * (1000 if step == big_step else 1)
        if step == nan_step:
            xb[0, 0] = float("nan")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
    gw.unwatch(model)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run with findings (NaN, explosion, loss spike), per-layer and per-parameter vectors."""
    root = tmp_path_factory.mktemp("pristine")
    train(root / "run")
    db = root / "run" / DB_NAME
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT COUNT(*) FROM findings").fetchone()[0] >= 2
    assert conn.execute("SELECT COUNT(*) FROM vectors WHERE codec = 1").fetchone()[0] >= 1
    # let any value be written, as a damaged file holds any: the NOT NULL constraints go (the records stay)
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute("UPDATE sqlite_master SET sql = replace(sql, 'NOT NULL', '') WHERE type = 'table'")
    conn.commit()
    conn.close()
    return db


def copy_run(pristine: Path, root: Path, name: str) -> Path:
    run = root / name
    run.mkdir(parents=True)
    shutil.copyfile(pristine, run / DB_NAME)
    return run


def damage(run: Path, *statements: tuple[str, tuple[Any, ...]]) -> None:
    conn = sqlite3.connect(run / DB_NAME)
    for sql, args in statements:
        conn.execute(sql, args)
    conn.commit()
    conn.close()


#: the damages the fault campaign found, each a few SQL statements
CASES: dict[str, list[tuple[str, tuple[Any, ...]]]] = {
    "meta-json": [("UPDATE meta SET value = '{bad' WHERE key = 'model'", ())],
    "meta-null": [("UPDATE meta SET value = NULL WHERE key = 'created'", ())],
    "meta-type": [("UPDATE meta SET value = '\"soon\"' WHERE key = 'created'", ())],
    "status-json": [("UPDATE meta SET value = 'running' WHERE key = 'status'", ())],
    "findings-json": [("UPDATE findings SET data = '{\"hint\": ' WHERE id = (SELECT MIN(id) FROM findings)", ())],
    "findings-list": [("UPDATE findings SET data = '[1, 2]'", ())],
    "findings-severity": [("UPDATE findings SET severity = 'fatal'", ())],
    "vector-not-zlib": [("UPDATE vectors SET data = X'00112233445566778899' WHERE codec = 1", ())],
    "vector-length": [("UPDATE vectors SET data = X'0000803F' WHERE codec = 0", ())],
    "vector-codec": [("UPDATE vectors SET codec = 7", ())],
    "mask-length": [("UPDATE vectors SET mask = X'FF'", ())],
    "bad-utf8-name": [("UPDATE entries SET name = CAST(X'FFFE41' AS TEXT) WHERE idx = 0", ())],
    "bad-utf8-meta": [("UPDATE meta SET value = CAST(X'22FF22' AS TEXT) WHERE key = 'model'", ())],
    "time-text": [("UPDATE steps SET time = 'noon' WHERE step = 3", ())],
    "step-text": [("UPDATE vectors SET step = 'seven' WHERE rowid = 3", ())],
    "numel-text": [("UPDATE entries SET numel = 'many'", ())],
    "layout-info": [("UPDATE layout_info SET data = '{\"owners\": [[99, 0]], \"saturating\": [], \"trainable\": []}'",
                     ())],
    "scalar-text": [("UPDATE scalars SET value = 'high' WHERE name = 'loss'", ())],
    "step-fraction": [("UPDATE scalars SET step = 0.5 WHERE step = 1", ())],
    "step-negative": [("UPDATE vectors SET step = -1 WHERE rowid = 2", ())],
}


#: damages in what ``ls`` and ``check`` read
READ_BY_CHECK = {"meta-json", "meta-null", "meta-type", "status-json", "findings-json", "findings-list",
                 "findings-severity", "bad-utf8-meta"}
#: damages in how vectors are packed, which ``check`` also scans for (one verdict with ``report``; issue 27, item 8)
PACKING = {"vector-codec", "vector-length", "mask-length"}


def read_everything(run: Path) -> None:
    """Every read a user, the CLI, the report or the dashboard makes: each succeeds or raises RunError."""
    with gw.open_run(run) as r:
        assert isinstance(r.meta, dict)
        r.status, r.steps, r.progress(), r.layers, r.parameters, r.layer_info(), r.layout(), r.step_info()
        list(r.records())
        r.scalars(), r.series("loss"), r.series("grad_norm"), r.skipped_steps()
        r.metrics(), r.metrics(per_parameter=True), r.matrix("grad_norm"), r.findings()
        if r.layers:
            r.metrics(layers=r.layers[:2])  # the sliced path: a few entries read inside SQLite
            r.metrics("grad_norm", layers=r.layers[-1])
        r.written_since("grad_norm"), r.measured_at("grad_norm"), r.verdict
        render(r)


def damaged_or_fine(run: Path) -> str:
    """Read everything; return 'fine' or 'damaged' (any other exception fails the test)."""
    try:
        read_everything(run)
    except DamagedStoreError as exc:
        assert str(exc).startswith("the run store ") and "\n" not in str(exc)
        return "damaged"
    except gw.RunError:
        return "unreadable"
    return "fine"


def check_served(root: Path, run_id: str) -> None:
    """The dashboard lists every run, and answers for this one without a 500."""
    client = TestClient(create_app(root), base_url="http://127.0.0.1", raise_server_exceptions=False)
    listed = client.get("/api/runs")
    assert listed.status_code == 200, listed.text
    rows = {row["id"]: row for row in listed.json()}
    assert rows[run_id]["status"] in STATUSES
    layers = client.get("/api/run/summary", params={"run": run_id})
    assert layers.status_code in (200, 422), layers.text
    layer = (layers.json().get("layers") or [{"name": "x"}])[0]["name"] if layers.status_code == 200 else "x"
    for path, extra in (("findings", {}), ("curves", {}), ("flow", {}), ("heatmap", {}), ("progress", {}),
                        ("layer", {"layer": layer})):
        response = client.get(f"/api/run/{path}", params={"run": run_id, **extra})
        assert response.status_code in (200, 404, 422), (path, response.status_code, response.text)
        assert "content-security-policy" in response.headers
    page = client.get("/")
    assert page.status_code == 200


# ------------------------------------------------------------------ the campaign's damages
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_value_is_reported_as_damage(pristine: Path, tmp_path: Path, case: str) -> None:
    (tmp_path / "rules.toml").write_text("[detectors.vanishing]\npatience = 5\n")
    good = copy_run(pristine, tmp_path, "good")
    bad = copy_run(pristine, tmp_path, "bad")
    damage(bad, *CASES[case])
    assert damaged_or_fine(good) == "fine"
    assert damaged_or_fine(bad) == "damaged", case
    rows = {row["run"]: row for row in (describe_run(p, tmp_path) for p in (good, bad))}
    assert rows["good"]["status"] == "finished"
    checked = judge_run(str(bad), "error", None)
    if case in READ_BY_CHECK:  # ls and check read the metadata, the steps and the findings
        assert rows["bad"]["status"] == "damaged" and "is damaged" in rows["bad"]["error"]
        assert checked.verdict == "error" and "is damaged" in str(checked.error)
    elif case in PACKING:  # check also scans the vectors' codecs and sizes (without decompressing them)
        assert rows["bad"]["status"] == "finished"
        assert checked.verdict == "error" and "is damaged" in str(checked.error)
        with pytest.raises(gw.RunError, match="is damaged"):  # the same damage, as any read of it says
            with gw.open_run(bad) as run:
                run.matrix("grad_norm")
    else:
        assert rows["bad"]["status"] == "finished" and checked.error is None
        rejudged = judge_run(str(bad), "error", tmp_path / "rules.toml")  # re-judging reads the statistics
        if case not in ("step-text", "step-negative"):  # (of the steps recorded: a vector of step 'seven' or -1
            # is no recorded step's)
            assert rejudged.verdict == "error" and "is damaged" in str(rejudged.error)
    check_served(tmp_path, "bad")


def test_a_finding_on_a_layer_without_series_is_read_and_reported(pristine: Path, tmp_path: Path) -> None:
    run = copy_run(pristine, tmp_path, "run")
    damage(run, ("UPDATE findings SET layer = '-1'", ()))  # a plugin's finding may name any module
    assert damaged_or_fine(run) == "fine"
    check_served(tmp_path, "run")


def test_a_flat_series_of_huge_values_is_reported(pristine: Path, tmp_path: Path) -> None:
    run = copy_run(pristine, tmp_path, "run")
    damage(run, ("UPDATE scalars SET value = 4503599637009776.0", ()))  # a loss stuck at 4.5e15 is no damage
    assert damaged_or_fine(run) == "fine"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gradwatch", *args], capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "300", "PATH": "/usr/bin:/bin"})


def clis(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Each command's ``cli`` (they only read the runs), two at a time: the processes, in order."""
    with ThreadPoolExecutor(2) as runner:
        return list(runner.map(lambda args: cli(*args), commands))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["meta-json", "findings-json", "bad-utf8-meta", "meta-null", "status-json"])
def test_the_cli_reports_a_damaged_run_in_one_line_and_lists_the_others(pristine: Path, tmp_path: Path,
                                                                       case: str) -> None:
    good = copy_run(pristine, tmp_path, "good")
    bad = copy_run(pristine, tmp_path, "bad")
    damage(bad, *CASES[case])
    failing = (("check", str(bad)), ("report", str(bad), "-o", str(tmp_path / "r.html")))
    *done_failing, both, listed, text = clis(*failing, ("check", str(good), str(bad), "--format", "json"),
                                             ("ls", str(tmp_path), "--format", "json"), ("ls", str(tmp_path)))
    for args, done in zip(failing, done_failing):
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stderr.startswith("gradwatch: error: the run store ") and "is damaged" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert both.returncode == 2
    assert [r["verdict"] for r in json.loads(both.stdout)] == ["fail", "error"], "the readable run is still judged"
    assert listed.returncode == 0, listed.stderr
    rows = {r["run"]: r for r in json.loads(listed.stdout)}
    assert rows["good"]["status"] == "finished" and rows["bad"]["status"] == "damaged"
    assert text.returncode == 0 and "damaged" in text.stdout and "good" in text.stdout


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PACKING))
def test_check_and_report_give_one_verdict_on_a_badly_packed_vector(pristine: Path, tmp_path: Path,
                                                                    case: str) -> None:
    bad = copy_run(pristine, tmp_path, "bad")
    damage(bad, *CASES[case])
    said = []
    commands = (("check", str(bad)), ("check", str(bad), "--format", "json"),
                ("report", str(bad), "-o", str(tmp_path / "r.html")))
    for args, done in zip(commands, clis(*commands)):
        assert done.returncode == 2, (args, done.stdout, done.stderr)  # check passed it (exit 0), report did not
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
        said.append(done.stderr)
    assert said[0] == said[1] == said[2] and "is damaged" in said[0], said


# ------------------------------------------------------------------ the fuzzer
TABLES = {
    "meta": ("key", "value"),
    "layouts": ("layout", "first_step"),
    "entries": ("layout", "scope", "idx", "name", "type", "numel", "leaf"),
    "layout_info": ("layout", "data"),
    "steps": ("step", "time", "layout", "logged", "sampled", "skipped"),
    "scalars": ("name", "step", "value"),
    "vectors": ("scope", "metric", "step", "layout", "codec", "data", "mask"),
    "findings": ("step", "kind", "severity", "layer", "phase", "message", "action", "data"),
}


class Utf8Damage(bytes):
    """Bytes written as TEXT: not valid UTF-8."""


VALUES = st.one_of(
    st.none(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.binary(max_size=48),
    st.sampled_from(["{bad", "[]", "null", "1e999", "NaN", '"x"', "{}", "[[0, 0]]", '{"owners": 1}', "layer", "param",
                     "grad_norm", "error", "0", "-1"]),
    st.builds(Utf8Damage, st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3", b'"\xff"'])),
)


@st.composite
def column_damage(draw: st.DrawFn) -> tuple[str, tuple[Any, ...]]:
    table = draw(st.sampled_from(sorted(TABLES)))
    column = draw(st.sampled_from(TABLES[table]))
    value = draw(VALUES)
    key = "step" if table == "scalars" else "rowid"  # scalars has no rowid
    every, offset = draw(st.integers(1, 4)), draw(st.integers(0, 3))
    cast = "CAST(? AS TEXT)" if isinstance(value, Utf8Damage) else "?"
    arg = bytes(value) if isinstance(value, Utf8Damage) else value
    return f"UPDATE OR IGNORE {table} SET {column} = {cast} WHERE abs({key}) % {every} = {offset % every}", (arg,)


@st.composite
def file_damage(draw: st.DrawFn) -> Callable[[bytes], bytes]:
    if draw(st.booleans()):
        cut = draw(st.integers(0, 200_000))
        return lambda data: data[: cut % (len(data) + 1)]
    flips = draw(st.lists(st.tuples(st.integers(0, 2**31), st.integers(1, 255)), min_size=1, max_size=8))

    def flip(data: bytes) -> bytes:
        out = bytearray(data)
        for at, bits in flips:
            out[at % len(out)] ^= bits
        return bytes(out)

    return flip


#: GRADWATCH_FUZZ_EXAMPLES=5000 runs a longer, random (not derandomized) campaign
FUZZ = int(os.environ.get("GRADWATCH_FUZZ_EXAMPLES", "0"))


def fuzz(pristine: Path) -> None:
    """The property: any damage to a copy of ``pristine`` (column values, then bit flips or truncation of
    the file) is read as damage or as fine, and never breaks listing, checking or serving the others."""

    @settings(max_examples=FUZZ or 150, deadline=None, derandomize=not FUZZ,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(column_damage(), min_size=1, max_size=3), st.one_of(st.none(), file_damage()))
    def any_damage_is_read_as_damage_and_never_breaks_the_others(statements: list,
                                                                 mangle: Callable[[bytes], bytes] | None) -> None:
        with tempfile.TemporaryDirectory() as folder:
            root = Path(folder)
            copy_run(pristine, root, "good")
            bad = copy_run(pristine, root, "bad")
            try:
                damage(bad, *statements)
            except (sqlite3.IntegrityError, OverflowError):
                pass  # a damage SQLite itself refuses to write
            if mangle is not None:
                (bad / DB_NAME).write_bytes(mangle((bad / DB_NAME).read_bytes()))
            assert damaged_or_fine(bad) in ("fine", "damaged", "unreadable")
            rows = {row["run"]: row for row in (describe_run(p, root) for p in (root / "good", bad))}
            assert rows["good"]["status"] == "finished" and rows["bad"]["status"] in STATUSES
            judged = judge_run(str(bad), "error", None)
            assert judged.verdict in ("pass", "fail", "error")
            check_served(root, "bad")

    any_damage_is_read_as_damage_and_never_breaks_the_others()


@pytest.fixture(scope="module")
def fuzzed(request: pytest.FixtureRequest, pristine: Path) -> Iterator[Future[Any] | None]:
    """The fuzzer given to the tests' pool (two processes beside this one) as the module begins, when this
    session runs it; its outcome to come."""
    runs = "test_any_damage_is_read_as_damage_and_never_breaks_the_others" in pool.tested(request)
    future = pool.submit(fuzz, pristine) if runs else None
    yield future
    if future is not None:
        future.cancel()  # a session stopped early (-x) runs no fuzzer it no longer tests


@pytest.fixture(scope="module", autouse=True)
def _fuzz_begins(fuzzed: Future[Any] | None) -> None:
    """Start the fuzzer with the module's first test."""


@pytest.mark.slow
def test_any_damage_is_read_as_damage_and_never_breaks_the_others(fuzzed: Future[Any] | None) -> None:
    assert fuzzed is not None
    pool.result(fuzzed)  # a falsifying example is raised here, with its traceback
