"""Dashboard faults: symlinks out of the root, internal errors, loopback addresses (issue 16, items 6 and 12)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from gradwatch.dashboards import data, server
from gradwatch.dashboards.server import SECURITY_HEADERS, create_app, start
from gradwatch.store.schema import DB_NAME
from tests.test_report import train

HEADERS = {name.decode(): value.decode() for name, value in SECURITY_HEADERS}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A root with one run of its own, and a run outside it that links inside the root point at."""
    root = tmp_path_factory.mktemp("root")
    outside = tmp_path_factory.mktemp("outside")
    train(root / "mine", steps=4)
    train(outside / "secret", steps=3)
    linked = root / "linked"
    linked.mkdir()
    (linked / DB_NAME).symlink_to(outside / "secret" / DB_NAME)
    inner = root / "inner"  # a link that stays inside the root is fine
    inner.mkdir()
    (inner / DB_NAME).symlink_to(root / "mine" / DB_NAME)
    return root, outside


# ------------------------------------------------------------------ item 6: file symlinks
def test_a_file_link_out_of_the_root_is_neither_listed_nor_served(folders: tuple[Path, Path]) -> None:
    root, _ = folders
    client = TestClient(create_app(root), base_url="http://127.0.0.1")
    listed = client.get("/api/runs")
    assert listed.status_code == 200
    ids = {row["id"] for row in listed.json()}
    assert "linked" not in ids and {"mine", "inner"} <= ids
    for path in ("/api/run/summary", "/api/run/findings", "/api/run/progress", "/api/events"):
        assert client.get(path, params={"run": "linked"}).status_code == 404, path
    assert client.get("/run", params={"run": "linked"}).status_code == 404
    assert client.get("/api/run/summary", params={"run": "inner"}).status_code == 200


def test_the_store_file_of_a_run_is_resolved_before_it_is_opened(folders: tuple[Path, Path]) -> None:
    root, outside = folders
    resolver = data.Root(root)
    with pytest.raises(data.NotFound):
        resolver.resolve("linked")
    with pytest.raises(data.NotFound):
        resolver.open("linked")
    # a WAL linked out of the root is refused too: SQLite would read it next to the store
    wal_run = root / "wal-linked"
    train(wal_run, steps=2)
    (outside / "elsewhere-wal").write_bytes(b"")
    (wal_run / f"{DB_NAME}-wal").symlink_to(outside / "elsewhere-wal")
    with pytest.raises(data.NotFound):
        resolver.resolve("wal-linked")
    assert "wal-linked" not in {row["id"] for row in resolver.runs()}


# ------------------------------------------------------------------ item 12: 500s keep the headers
def test_an_internal_error_is_a_500_with_the_security_headers(folders: tuple[Path, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = folders

    def broken(run: object) -> object:
        raise RuntimeError("an injected bug")

    monkeypatch.setattr(data, "findings", broken)
    client = TestClient(create_app(root), base_url="http://127.0.0.1", raise_server_exceptions=False)
    response = client.get("/api/run/findings", params={"run": "mine"})
    assert response.status_code == 500
    for name, value in HEADERS.items():
        assert response.headers.get(name) == value, name
    assert "injected" not in response.text and "Traceback" not in response.text
    assert client.get("/api/run/summary", params={"run": "mine"}).status_code == 200, "the others still work"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "127.1.2.3", "localhost", "::1", "0:0:0:0:0:0:0:1"])
def test_loopback_addresses_are_loopback(host: str) -> None:
    assert server.is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "10.0.0.1", "example.com", ""])
def test_other_addresses_are_not(host: str) -> None:
    assert not server.is_loopback(host)


def test_any_loopback_address_keeps_the_host_check(folders: tuple[Path, Path]) -> None:
    root, _ = folders
    client = TestClient(create_app(root, host="127.0.0.2"), base_url="http://127.0.0.2:6007")
    assert client.get("/api/runs").status_code == 200, "its own address is served"
    assert client.get("/api/runs", headers={"host": "localhost:6007"}).status_code == 200
    assert client.get("/api/runs", headers={"host": "attacker.example"}).status_code == 400, "DNS rebinding"
    # another address is not a loopback one: served to any host, as documented
    open_client = TestClient(create_app(root, host="0.0.0.0"), base_url="http://192.0.2.1")
    assert open_client.get("/api/runs", headers={"host": "attacker.example"}).status_code == 200


@pytest.mark.slow
def test_a_real_server_on_127_0_0_2_refuses_other_hosts(folders: tuple[Path, Path]) -> None:
    root, _ = folders
    with start(root, host="127.0.0.2") as dash:
        assert dash.url.startswith("http://127.0.0.2:")
        assert httpx.get(dash.url + "api/runs", timeout=10).status_code == 200
        forged = httpx.get(dash.url + "api/runs", headers={"host": "attacker.example"}, timeout=10)
        assert forged.status_code == 400
        for name, value in HEADERS.items():
            assert forged.headers.get(name) == value, name


@pytest.mark.slow
def test_cli_on_a_loopback_address_does_not_warn(folders: tuple[Path, Path]) -> None:
    root, _ = folders
    process = subprocess.Popen([sys.executable, "-m", "gradwatch", "dashboard", str(root), "--host", "127.0.0.2",
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.2:\d+/)", line)
        assert found, line
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.get(found.group(1) + "api/runs", headers={"host": "attacker.example"}, timeout=5)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert response.status_code == 400
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    assert "anyone" not in err and "warning" not in err, err
