"""How a run ended (issue 27, item 4): preemption by SIGTERM, ``sys.exit(N)``, and ``check``'s verdict on it.

Each training runs in a process of its own, as a cluster job does, and is ended the way a cluster or
a script ends one: a SIGTERM with or without a handler of the user's, ``sys.exit(1)``, ``sys.exit("msg")``.
The trainings the tests read are started as the module begins, one after the other beside the test process,
each in a folder of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch as gw
from tests.test_check import gradwatch

SCRIPT = r'''
import os, signal, sys, time
import torch
from torch import nn
import gradwatch as gw

mode, run, where = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)

def user_handler(signum, frame):
    print(f"user handler {signum}", flush=True)
    sys.exit(143)

if mode == "handler_before":
    signal.signal(signal.SIGTERM, user_handler)
kept = []


def main():  # the model a local of main() (freed as a sys.exit unwinds), unless where == "module"
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    gw.watch(model, run=run, console=False, flush_seconds=600)  # nothing is committed unless gradwatch flushes
    if where == "module":  # the model lives to the end, as a module-level one does
        kept.append(model)
    stop = []
    if mode == "handler_after":
        signal.signal(signal.SIGTERM, user_handler)
    if mode == "graceful_after":  # a framework's handler that calls the one before it, then stops the loop itself
        before = signal.getsignal(signal.SIGTERM)
        def graceful(signum, frame):
            before(signum, frame)
            stop.append(signum)
        signal.signal(signal.SIGTERM, graceful)
    if mode == "inside_hook":  # the signal arrives while gradwatch's step hook runs (at step 30's moment)
        steps = iter(range(100000))
        gw.watcher(model).integrate(on_halt=print, before_step=lambda: next(steps) == 30 and os.kill(os.getpid(),
                                                                                                    signal.SIGTERM))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(100000):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}", flush=True)
        if step == 20:
            if mode == "exit1":
                sys.exit(1)
            if mode == "exitmsg":
                sys.exit("out of data")
            if mode == "exit0":
                sys.exit(0)
            if mode == "exit_caught":  # an argument parser's exit, caught: training goes on and finishes
                try:
                    sys.exit(2)
                except SystemExit:
                    pass
            print("ready", flush=True)
        if mode == "exit_caught" and step == 25:
            break
        if stop:
            print("stopped gracefully", flush=True)
            break
        if step > 20:
            time.sleep(0.002)


main()
'''


def _train(tmp_path: Path, mode: str, *, terminate: bool, where: str = "module") -> tuple[int, str, str, Path]:
    """Run the script in ``mode``; with ``terminate``, send it SIGTERM once it is training past step 20.

    ``where``: ``"module"`` keeps the model to the process's end, as a module-level model; ``"main"`` leaves
    it a local of the script's ``main()``, freed as a ``sys.exit`` unwinds, before ``atexit``.
    """
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = tmp_path / f"run-{mode}-{where}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, str(script), mode, str(run), where], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    assert proc.stdout is not None
    lines = []
    timer = threading.Timer(600, proc.kill)  # a child that hangs cannot hang the test (a loaded machine is slow)
    timer.start()
    try:
        if terminate:
            for line in proc.stdout:  # the child prints every step: this ends at "ready", or when it dies
                lines.append(line)
                if line.strip() == "ready":
                    break
            if not lines or lines[-1].strip() != "ready":
                proc.kill()
                out, err = proc.communicate()
                pytest.fail(f"the training never got ready: {''.join(lines)}{out}{err}")
            time.sleep(0.2)  # some steps past step 20, not yet committed (flush_seconds=600)
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, "".join(lines) + out, err, run


#: the trainings the tests read, by test: (mode, terminate, where) of ``_train``, from the test's parameters
TRAININGS: dict[str, Callable[[dict[str, Any]], tuple[str, bool, str]]] = {
    "test_sigterm_without_a_handler_closes_the_run_as_terminated_and_dies_by_the_signal":
        lambda params: ("plain", True, "module"),
    "test_sigterm_inside_a_hook_of_gradwatch_closes_the_run_once_the_hook_returns":
        lambda params: ("inside_hook", False, "module"),
    "test_sigterm_calls_the_users_handler_installed_before_watch": lambda params: ("handler_before", True, "module"),
    "test_a_handler_installed_after_watch_decides_and_its_exit_code_is_recorded":
        lambda params: ("handler_after", True, params["where"]),
    "test_a_framework_handler_that_chains_to_gradwatch_keeps_the_process_alive":
        lambda params: ("graceful_after", True, "module"),
    "test_sys_exit_records_its_code": lambda params: (params["mode"], False, params["where"]),
}
#: what ``trained`` gives: by (mode, terminate, where), what ``_train`` returns, to come
Trained = dict[tuple[str, bool, str], Future[tuple[int, str, str, Path]]]


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    """The trainings of the tests this session runs, started one after the other as the module begins (beside
    the test process), each in a folder of its own: their outcomes to come."""
    with ThreadPoolExecutor(1) as runner:
        started: Trained = {}
        for item in request.session.items:
            name = getattr(item, "originalname", None)
            if getattr(item, "module", None) is request.module and name in TRAININGS:
                args = TRAININGS[name](item.callspec.params if hasattr(item, "callspec") else {})
                if args not in started:
                    mode, terminate, where = args
                    started[args] = runner.submit(_train, tmp_path_factory.mktemp(f"{mode}-{where}"), mode,
                                                  terminate=terminate, where=where)
        yield started
        for future in started.values():
            future.cancel()  # a session stopped early (-x) runs no training it no longer tests


@pytest.fixture(scope="module", autouse=True)
def _trainings_begin(trained: Trained) -> None:
    """Start the trainings with the module's first test."""


def _last_step(out: str) -> int:
    return max(int(line.split()[1]) for line in out.splitlines() if line.startswith("step "))


@pytest.mark.slow
def test_sigterm_without_a_handler_closes_the_run_as_terminated_and_dies_by_the_signal(trained: Trained) -> None:
    code, out, err, run = trained[("plain", True, "module")].result()
    assert code == -signal.SIGTERM, f"the process ends by SIGTERM, as without gradwatch ({code}): {err}"
    assert "Traceback" not in err
    with gw.open_run(run) as r:
        assert r.status == "terminated"
        assert r.ended == {"status": "terminated", "signal": 15}
        assert r.steps >= _last_step(out) + 1 > 21, "every step trained before the signal is on disk"
        assert r.verdict is not None and r.verdict["signal"] == 15
    # check fails a run that did not finish, and says how it ended; --accept passes it
    res = gradwatch("check", str(run))
    assert res.returncode == 1
    assert "UNFINISHED" in res.stdout and "terminated (signal 15, SIGTERM)" in res.stdout
    data = json.loads(gradwatch("check", str(run), "--format", "json").stdout)
    assert data["verdict"] == "fail" and data["unfinished"] is True
    assert data["ended"] == {"status": "terminated", "signal": 15}
    assert gradwatch("check", str(run), "--accept", "terminated").returncode == 0
    assert gradwatch("check", str(run), "--accept", "unfinished").returncode == 0
    assert gradwatch("check", str(run), "--accept", "exited").returncode == 1
    bad = gradwatch("check", str(run), "--accept", "preempted")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "'preempted'" in bad.stderr
    listed = json.loads(gradwatch("ls", str(run.parent), "--format", "json").stdout)  # the training's folder
    assert [(row["status"], row["status_detail"]) for row in listed] == [
        ("terminated", "terminated (signal 15, SIGTERM)")]
    assert "terminated (signal 15, SIGTERM)" in gradwatch("ls", str(run.parent)).stdout


@pytest.mark.slow
def test_sigterm_inside_a_hook_of_gradwatch_closes_the_run_once_the_hook_returns(trained: Trained) -> None:
    code, out, err, run = trained[("inside_hook", False, "module")].result()
    assert code == -signal.SIGTERM, err
    assert _last_step(out) == 29, "the step the signal stopped did not reach the loop"
    with gw.open_run(run) as r:
        assert r.ended == {"status": "terminated", "signal": 15}
        assert r.steps == 31, "the step in progress was recorded whole, after its hook returned"


@pytest.mark.slow
def test_sigterm_calls_the_users_handler_installed_before_watch(trained: Trained) -> None:
    code, out, err, run = trained[("handler_before", True, "module")].result()
    assert "user handler 15" in out
    assert code == 143, err
    with gw.open_run(run) as r:
        assert r.ended == {"status": "terminated", "signal": 15, "code": 143}
        assert r.steps >= _last_step(out) + 1


@pytest.mark.slow
@pytest.mark.parametrize("where", ["module", "main"])
def test_a_handler_installed_after_watch_decides_and_its_exit_code_is_recorded(trained: Trained, where: str) -> None:
    """Also with the model a local of ``main()``: freed as the handler's ``SystemExit`` unwinds, before
    ``atexit``, its run closes as the exit ends it (it read ``finished``)."""
    code, out, err, run = trained[("handler_after", True, where)].result()
    assert "user handler 15" in out and code == 143, err
    with gw.open_run(run) as r:
        assert r.ended == {"status": "exited", "code": 143}
        assert r.steps >= _last_step(out) + 1


#: the user's SIGTERM handler, installed after ``gw.watch``, runs at a chosen point inside gradwatch's hooks, as
#: a signal does (CPython runs a handler between two bytecodes of whatever Python code runs then). Each try is a
#: process forked from this one that trains from scratch; every try that goes wrong prints one line.
INTERRUPTED = r"""
import atexit, contextlib, json, os, signal, sys, time, traceback
import torch
from torch import nn
import gradwatch as gw
from gradwatch.watching import guard
from gradwatch.step.recording import Recording

where, root = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
# close: every bytecode of the forward pre-hook's close of step 25, which hands it to the writer thread;
# submit: every bytecode of the hand-over of sampled step 30 (pending until step 31's read of its update);
# hooks: the start of each hook kind that step 30 (a sampled step) runs
AT = {"close": 26, "submit": 31, "hooks": 30}[where]
WINDOW = {"close": Recording.close_step, "submit": Recording.submit}.get(where)
KEEP = []


def user_handler(signum, frame):
    sys.exit(143)


def deliver():
    signal.getsignal(signal.SIGTERM)(signal.SIGTERM, sys._getframe(1))  # what a SIGTERM arriving now does


class AtBytecode:
    # Runs the SIGTERM handler at the n-th bytecode run inside WINDOW's calls (n=0: counts them).
    def __init__(self, n):
        self.n, self.seen = n, 0

    def __enter__(self):
        sys.settrace(self.call)

    def __exit__(self, *exc):
        sys.settrace(None)

    def call(self, frame, event, arg):
        inside = frame
        while inside is not None and inside.f_code is not WINDOW.__code__:
            inside = inside.f_back
        if inside is None:
            return None
        frame.f_trace_opcodes = True
        return self.opcode

    def opcode(self, frame, event, arg):
        if event == "opcode":
            self.seen += 1
            if self.seen == self.n:
                deliver()
        return self.opcode


def train(run, arm):
    # SCRIPT's handler_after mode: the handler is installed after gw.watch; ``arm`` is around step AT
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    KEEP.append(model)  # a module's global, as in SCRIPT: alive until the interpreter exits
    gw.watch(model, run=run, console=False, flush_seconds=600)
    signal.signal(signal.SIGTERM, user_handler)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(AT + 3):
        with arm if step == AT else contextlib.nullcontext():
            loss = model(torch.randn(16, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        trained[0] = step + 1


def start(name, arm):
    # Fork a process that trains with ``arm``; its pid
    run = os.path.join(root, name)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(os.open(run + ".err", os.O_WRONLY | os.O_CREAT), 2)
            try:
                train(run, arm)
                code = 0
            except SystemExit as exc:
                code = exc.code
            counted = arm.seen if isinstance(arm, AtBytecode) else dict(guard.ENTERED)
            with open(run + ".json", "w") as fh:
                json.dump({"trained": trained[0], "counted": counted}, fh)
            atexit._run_exitfuncs()  # what the interpreter runs as it exits (its finalization is left out)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def finish(name, pid):
    # What the forked try left: (exit code or None if it hung, steps trained, what its arm counted)
    deadline = time.monotonic() + 60  # a hung close is a failure, not a hung test
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None, 0, None
        time.sleep(0.005)
    with open(os.path.join(root, name + ".json")) as fh:
        left = json.load(fh)
    return os.waitstatus_to_exitcode(status), left["trained"], left["counted"]


def attempt(name, arm):
    # Train in a forked process; what it left (see finish)
    return finish(name, start(name, arm))


def check(name, pid):
    code, trained, _ = finish(name, pid)
    if code is None:
        print(f"{name}: the process hung as it exited", flush=True)
        return
    with gw.open_run(os.path.join(root, name)) as r:
        ended, steps = r.ended, r.steps
    with open(os.path.join(root, name + ".err")) as fh:
        err = fh.read()
    if code != 143 or ended != {"status": "exited", "code": 143} or steps < trained or err:
        print(f"{name}: exit {code}, {ended}, {steps} steps stored of {trained} trained; stderr {err!r}", flush=True)


def check_all(tries):
    # Each (name, arm) tried in its forked process, two at a time (the tries are independent: two cores)
    running = []
    for name, arm in tries:
        running.append((name, start(name, arm)))
        if len(running) == 2:
            check(*running.pop(0))
    for name, pid in running:
        check(name, pid)


# the first watch of a process imports what it writes with (TensorBoard, SQLite ...): done once, here
warm = nn.Linear(4, 1)
gw.watch(warm, run=os.path.join(root, "warm"), console=False)
warm_opt = torch.optim.SGD(warm.parameters(), lr=0.01)
for _ in range(3):
    warm(torch.randn(2, 4)).sum().backward()
    warm_opt.step()
gw.unwatch(warm)
trained = [0]
if where == "hooks":
    _, _, kinds = attempt("count", guard.inject(None))
    check_all([(kind, guard.inject(kind, fault=deliver)) for kind in sorted(kinds)])
    print(f"tried {len(kinds)} hook kinds: {sorted(kinds)}")
else:
    _, _, total = attempt("count", AtBytecode(0))
    check_all([(f"bytecode-{n}", AtBytecode(n)) for n in range(1, total + 1)])
    print(f"tried {total} bytecodes")
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="each try is a forked process")
@pytest.mark.parametrize("where", ["close", "submit", "hooks"])
def test_a_handler_exit_anywhere_inside_a_hook_is_recorded_as_exited_with_every_trained_step(
        tmp_path: Path, where: str) -> None:
    """The CI failure this pins: the handler's SystemExit raised inside ``Thread.is_alive`` (the writer hand-over's
    check that the writer thread runs) marked the running writer thread stopped (CPython issue 90882), so the run
    was never closed: ``running`` in its store, read as ``crashed``, no step written. Inside ``queue.Queue.put``
    it left the queue's lock held, and the process hung at exit; between the step's close and the hand-over, the
    step was lost.
    """
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run([sys.executable, str(script), where, str(tmp_path)], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=1800)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines and lines[-1].startswith("tried "), res.stdout + res.stderr
    tried = int(lines[-1].split()[1])
    assert tried >= (8 if where == "hooks" else 20), lines[-1]  # the window held what it is meant to
    assert lines[:-1] == [], f"{len(lines) - 1} of {tried} tries went wrong:\n" + "\n".join(lines[:-1])


@pytest.mark.slow
def test_a_framework_handler_that_chains_to_gradwatch_keeps_the_process_alive(trained: Trained) -> None:
    code, out, err, run = trained[("graceful_after", True, "module")].result()
    assert "stopped gracefully" in out, "gradwatch's handler, called by the later one, did not end the process"
    assert code == 0, err
    with gw.open_run(run) as r:
        assert r.ended == {"status": "terminated", "signal": 15}
        assert r.steps == _last_step(out) + 1


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "where", "ended"), [
    ("exit1", "module", {"status": "exited", "code": 1}),
    ("exit1", "main", {"status": "exited", "code": 1}),  # the model freed as the exit unwinds: still exited
    ("exitmsg", "module", {"status": "exited", "code": 1, "message": "out of data"}),
    ("exit0", "module", {"status": "finished"}),
    ("exit_caught", "module", {"status": "finished"}),
    ("exit_caught", "main", {"status": "finished"}),  # freed as main() returns after the caught exit: finished
])
def test_sys_exit_records_its_code(trained: Trained, mode: str, where: str, ended: dict[str, object]) -> None:
    code, out, err, run = trained[(mode, False, where)].result()
    assert code == ended.get("code", 0), err
    with gw.open_run(run) as r:
        assert r.ended == ended
        assert r.steps == (26 if mode == "exit_caught" else 21)
    res = gradwatch("check", str(run))
    assert res.returncode == (1 if ended["status"] == "exited" else 0), res.stdout
    if ended["status"] == "exited":
        assert f"exited (code 1{': out of data' if 'message' in ended else ''})" in res.stdout
        assert gradwatch("check", str(run), "--accept", "exited").returncode == 0


def _train_in_block(run: Path, raised: BaseException) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gw.watcher(gw.watch(model, run=run, console=False)):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 3)).sum().backward()
            opt.step()
        raise raised


@pytest.mark.parametrize(("raised", "ended"), [
    (SystemExit(3), {"status": "exited", "code": 3}),
    (SystemExit("no more data"), {"status": "exited", "code": 1, "message": "no more data"}),
    (SystemExit(0), {"status": "finished"}),
    (ValueError("bad batch"), {"status": "crashed", "exception": "ValueError: bad batch"}),
])
def test_a_with_block_closes_its_run_with_how_it_ended(tmp_path: Path, raised: BaseException,
                                                       ended: dict[str, object]) -> None:
    with pytest.raises(type(raised)):
        _train_in_block(tmp_path / "run", raised)
    with gw.open_run(tmp_path / "run") as r:
        assert r.ended == ended and r.steps == 3
