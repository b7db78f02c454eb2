"""Two dashboards started at once on one port (issue 27, item 7): one serves, the other says so in one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gradwatch.dashboards import server
from gradwatch.errors import GradwatchError

HOST = "127.0.0.1"


def test_bind_listens_so_a_second_bind_on_the_port_fails_at_once() -> None:
    first = server.bind(HOST, 0)
    try:
        port = first.getsockname()[1]
        # both could bind with SO_REUSEADDR while neither listened: the second then failed in uvicorn
        with pytest.raises(GradwatchError, match=rf"cannot listen on {HOST}:{port}: .*--port 0 picks a free one"):
            server.bind(HOST, port)
    finally:
        first.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
def test_two_dashboards_racing_for_one_port(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for _ in range(4):
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, "-m", "gradwatch", "dashboard", str(tmp_path), "--port", str(port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for _ in range(2)]
        try:
            deadline = time.monotonic() + 60
            while all(p.poll() is None for p in procs):
                assert time.monotonic() < deadline, "neither dashboard gave up the port"
                time.sleep(0.05)
            loser = next(p for p in procs if p.poll() is not None)
            winner = next(p for p in procs if p is not loser)
            out, err = loser.communicate(timeout=30)
            assert loser.returncode == 2, (out, err)
            assert out == "", "the loser printed a URL it does not serve"
            assert err.count("\n") == 1 and "Traceback" not in err, err
            assert err.startswith(f"gradwatch: error: cannot listen on {HOST}:{port}: "), err
            assert winner.stdout is not None
            assert f"http://{HOST}:{port}/" in winner.stdout.readline()
            response = httpx.get(f"http://{HOST}:{port}/api/runs", timeout=10)
            assert response.status_code == 200
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
                    p.communicate(timeout=30)
        assert winner.returncode == 0
