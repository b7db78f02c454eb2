"""Processes and threads of a watched training (issue 34): a forked child goes quiet, a spawned one is unwatched.

A child forked after ``gw.watch`` (``os.fork``, multiprocessing's ``fork``, a DataLoader worker) inherits
the parent's watcher but not its writer thread: it exited only by waiting for that thread, and blocked in
``optimizer.step()`` once the writer's queue was full (~1,000 steps). A spawned child unpickles the model,
which holds nothing of gradwatch. Each case runs as a script in a session of its own, killed whole when it
outlives its timeout (a hang fails the test, never the suite), and asserts: the children exit with their
code, the parent's run is ``finished`` with exactly its own steps, ``check`` passes, and no
``InternalWarning`` is printed by any of the processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gradwatch as gw
from tests.test_check import gradwatch

SCRIPT = r'''
import json, os, sys, threading
from concurrent.futures import ThreadPoolExecutor
import torch
from torch import nn

BEFORE = AFTER = 10  # the parent's steps before and after the children
SPARE = []  # an instance of a watched class that the parent never runs


def hooks(model):
    """The hooks on the model, its parameters, and torch's global ones (gradwatch's are gone in a forked child)."""
    from torch.nn.modules import module
    from torch.optim import optimizer
    found = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    found += sum(len(p._backward_hooks or {}) + len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return found + sum(len(getattr(where, name)) for where in (module, optimizer) for name in dir(where)
                       if name.startswith("_global_") and name.endswith("hooks"))


def train(model, steps, seed, opt=None, observe=None):
    """Plain SGD on random batches of a fixed seed; ``observe(loss=...)`` at each step when given."""
    g = torch.Generator().manual_seed(seed)
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=g)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if observe is not None:
            observe(loss=loss)
        opt.step()


def tell(**what):
    sys.stdout.flush()
    os.write(1, ("CHILD " + json.dumps(what) + "\n").encode())  # one write: workers print side by side


def worker(model, rank, steps):
    """A Hogwild worker: trains the shared model (fork: inherited; spawn: unpickled)."""
    torch.set_num_threads(1)
    tell(rank=rank, gradwatch="gradwatch" in sys.modules, hooks=hooks(model))
    train(model, steps, rank + 1)


class Pairs(torch.utils.data.Dataset):
    """64 seeded samples."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g), torch.randn(1, generator=g)


def forked(model, mode, run, closed_read):
    """The child of os.fork: ends as ``mode`` says."""
    if mode == "class":  # instances of the watched class made before the fork and in the child: not watched here
        fresh = type(model)(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        for other in (SPARE[0], fresh):
            train(other, 5, 7)
        tell(hooks=hooks(model) + hooks(SPARE[0]) + hooks(fresh))
        sys.exit(0)
    tell(hooks=hooks(model))
    import gradwatch as gw
    if mode == "rewatch":  # watched again, into a run of its own
        gw.watch(model, run=run + "-child", console=False)
        train(model, 30, 7, observe=gw.watcher(model).observe)
        sys.exit(0)
    if mode == "outlives":  # trains and ends after the parent closed its run
        os.read(closed_read, 1)
    # the loop it shares with the parent: gw.watcher(model) answers, and its calls do nothing
    train(model, 2000 if mode == "train" else 5, 7, observe=gw.watcher(model).observe)
    if mode == "outlives":
        sys.exit(0)
    if mode in ("exit", "train"):
        sys.exit(0)
    if mode == "os_exit":
        os._exit(3)
    if mode == "raise":
        raise RuntimeError("the child failed")
    # "return": it returns from main() and the interpreter ends as a script's does


def main(mode, run):
    import gradwatch as gw  # here: a spawned child imports this script, never gradwatch (the pickle holds none)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if mode == "fork_class":  # every instance watched (at its first forward)
        @gw.watch(run=run, console=False)
        class Net(nn.Sequential):
            pass
        model = Net(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        SPARE.append(Net(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))  # not run before the fork: not watched yet
    else:
        model = gw.watch(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), run=run, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train(model, BEFORE, 0, opt)
    steps, codes = BEFORE + AFTER, []
    if mode.startswith("fork_"):
        closed_read, closed_write = os.pipe()  # the parent tells its run's close to a child that outlives it
        pid = os.fork()
        if pid == 0:
            forked(model, mode[5:], run, closed_read)
            return
        if mode == "fork_outlives":
            train(model, AFTER, 3, opt)
            gw.unwatch(model)
            os.write(closed_write, b"x")
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        if mode == "fork_outlives":
            print("PARENT " + json.dumps({"codes": codes, "steps": steps}), flush=True)
            return
    elif mode.startswith("hogwild_"):
        import torch.multiprocessing as mp
        model.share_memory()
        ctx = mp.get_context(mode[8:])
        workers = [ctx.Process(target=worker, args=(model, rank, 1500)) for rank in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        codes = [w.exitcode for w in workers]
    elif mode.startswith("loader_"):
        loader = torch.utils.data.DataLoader(Pairs(), batch_size=8, num_workers=2, multiprocessing_context=mode[7:])
        for _ in range(2):
            for x, y in loader:
                loss = (model(x) - y).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                steps += 1
    elif mode == "thread":  # a second thread runs steps of the watched model while the first waits
        helper = threading.Thread(target=train, args=(model, 30, 1, opt, gw.watcher(model).observe))
        helper.start()
        helper.join()
        steps += 30
    elif mode == "pool":  # inference in a thread pool while the main thread trains
        def infer(i):
            with torch.no_grad():
                return float(model(torch.full((8, 4), float(i % 7))).sum())
        with ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(infer, i) for i in range(200)]
            train(model, 40, 2, opt, gw.watcher(model).observe)
            [a.result() for a in answers]
        steps += 40
    train(model, AFTER, 3, opt)
    gw.unwatch(model)
    print("PARENT " + json.dumps({"codes": codes, "steps": steps}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


def run_script(tmp_path: Path, mode: str, timeout: float) -> tuple[dict[str, Any], list[dict[str, Any]], str, Path]:
    """Run the script in ``mode`` in a session of its own; a hang past ``timeout`` kills it whole and fails.

    Returns:
        the parent's report, the children's reports, everything printed to stderr, the run's path.
    """
    script, run = tmp_path / "train.py", tmp_path / "run"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, str(script), mode, str(run)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the parent, and the children it waits for
        out, err = proc.communicate()
        pytest.fail(f"{mode}: hung (killed after {timeout:g} s); stdout ends {out[-1500:]!r}, "
                    f"stderr ends {err[-1500:]!r}")
    assert proc.returncode == 0, f"{mode}: the parent exited {proc.returncode}:\n{err[-3000:]}"
    lines = out.splitlines()
    parent = [json.loads(line[7:]) for line in lines if line.startswith("PARENT ")]
    assert len(parent) == 1, out
    children = [json.loads(line[6:]) for line in lines if line.startswith("CHILD ")]
    return parent[0], children, err, run


def assert_parent_run(run: Path, steps: int, err: str, losses: int = 0) -> None:
    """The parent's run finished with exactly its own steps (``losses`` of them observed a loss), passes
    ``check``, and nothing said InternalWarning.
    """
    assert "InternalWarning" not in err, err[-3000:]
    with gw.open_run(run) as read:
        assert read.status == "finished"
        assert read.steps == steps
        read.check_vectors()  # a child never wrote into the parent's store, nor closed it
        scalars = read.scalars()
        assert int(scalars["loss"].notna().sum() if "loss" in scalars else 0) == losses  # a child's loss never
    checked = gradwatch("check", str(run), "--format", "json")
    assert checked.returncode == 0, checked.stdout
    report = json.loads(checked.stdout)
    assert (report["status"], report["steps"], report["findings"]) == ("finished", steps, [])


#: os.fork after watch: what the child does (how it ends; trains 2,000 steps; ends after the parent closed its run;
#: makes and trains a new instance of the watched class), and its exit code
FORKED = {"exit": 0, "os_exit": 3, "return": 0, "raise": 1, "train": 0, "outlives": 0, "class": 0}


@pytest.mark.slow
@pytest.mark.parametrize("child", list(FORKED))
def test_a_forked_child_goes_quiet_and_exits(tmp_path: Path, child: str) -> None:
    parent, children, err, run = run_script(tmp_path, f"fork_{child}", timeout=120)
    assert parent["codes"] == [FORKED[child]]
    assert children == [{"hooks": 0}]  # the inherited watcher's hooks are gone: the child pays nothing
    if child == "raise":
        assert "RuntimeError: the child failed" in err
    assert_parent_run(run, parent["steps"], err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "train.py"]  # the child wrote no run


@pytest.mark.slow
def test_a_forked_child_watched_again_records_a_run_of_its_own(tmp_path: Path) -> None:
    parent, children, err, run = run_script(tmp_path, "fork_rewatch", timeout=120)
    assert parent["codes"] == [0] and children == [{"hooks": 0}]
    assert_parent_run(run, parent["steps"], err)
    with gw.open_run(tmp_path / "run-child") as child:
        assert (child.status, child.steps) == ("finished", 30)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_hogwild_workers_train_the_shared_model_unwatched(tmp_path: Path, method: str) -> None:
    parent, children, err, run = run_script(tmp_path, f"hogwild_{method}", timeout=300)
    assert parent["codes"] == [0, 0]
    # fork: the inherited hooks removed; spawn: the unpickled model has none, and nothing imported gradwatch
    expected = [{"rank": r, "gradwatch": method == "fork", "hooks": 0} for r in range(2)]
    assert sorted(children, key=lambda c: c["rank"]) == expected
    assert_parent_run(run, parent["steps"], err)


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers(tmp_path: Path, context: str) -> None:
    parent, _, err, run = run_script(tmp_path, f"loader_{context}", timeout=300)
    assert parent["steps"] == 20 + 16
    assert_parent_run(run, parent["steps"], err)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["thread", "pool"])
def test_threads_step_or_infer_with_the_watched_model(tmp_path: Path, how: str) -> None:
    parent, _, err, run = run_script(tmp_path, how, timeout=120)
    trained = 30 if how == "thread" else 40
    assert parent["steps"] == 20 + trained
    assert_parent_run(run, parent["steps"], err, losses=trained)
