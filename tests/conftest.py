"""Shared fixtures: seeded torch, a fresh run directory, and a plain training loop."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw

# One thread per process: the tests' models are small, and on a machine of few cores torch's default
# (a thread per core) is slower (the threads spin against each other and against the processes a test
# starts) and differs from machine to machine. Subprocesses (the CLI, the examples, the distributed
# ranks) inherit it through OMP_NUM_THREADS; a value set outside the suite wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _seeded() -> Iterator[None]:
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_leftover_watchers() -> Iterator[None]:
    """Every test leaves no model watched behind (and its runs closed)."""
    yield
    from gradwatch.watching import registry

    for watcher in list(registry._live):
        watcher.close()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Small models on a shared 2-core machine: one thread is faster and the same on every run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def train(
    model: nn.Module,
    batches: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    steps: int,
    optimizer: torch.optim.Optimizer | None = None,
    observe: bool = True,
) -> torch.optim.Optimizer:
    """An ordinary training loop: zero_grad, forward, backward, observe(loss), step."""
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x, y = batches()
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        if observe:
            gw.watcher(model).observe(loss=loss)
        opt.step()
    return opt


#: shared contract tests that gradwatch.testing ships (so they cannot carry our marker: a plugin author's
#: suite need not know it): the ones that train a run, or use the healthy records, are slow here; those that
#: only check classes are not
SLOW_CONTRACT_TESTS = {"test_healthy_training_gives_no_warning_or_error",  # the 300-step healthy run
                       "test_applied_before_the_update_of_the_step_that_called_for_it"}  # trains until it fires


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name = getattr(item, "originalname", item.name)
        if name in SLOW_CONTRACT_TESTS or "gradwatch_healthy_records" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)  # the healthy records: a 300-step run, trained once per session


#: an unmarked test slower than this is listed at the end of the run: mark it ``slow`` (or make it faster),
#: so that ``python -m pytest -m "not slow"`` stays a run of under 2 minutes
SLOW_SECONDS = 5.0
_unmarked_slow: list[tuple[str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # the setup counts too: a module's fixture that trains for seconds is paid by its first test
    if report.when in ("setup", "call") and report.duration > SLOW_SECONDS and "slow" not in report.keywords:
        _unmarked_slow.append((f"{report.nodeid} ({report.when})", report.duration))


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if _unmarked_slow:
        terminalreporter.section(f"tests not marked slow that took more than {SLOW_SECONDS:g} s")
        for nodeid, seconds in sorted(_unmarked_slow, key=lambda x: -x[1]):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}  (mark it @pytest.mark.slow, or its module)")


CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="session")
def browser():  # type: ignore[no-untyped-def]
    required = os.environ.get("GRADWATCH_REQUIRE_BROWSER") == "1"
    if not Path(CHROMIUM).exists():
        if required:
            pytest.fail(f"{CHROMIUM} is missing and GRADWATCH_REQUIRE_BROWSER=1: the browser test must run")
        pytest.skip(f"no Chromium at {CHROMIUM}: install Debian's chromium to run the browser tests")
    try:
        from playwright import sync_api
    except ImportError:
        if required:
            pytest.fail("playwright is not installed and GRADWATCH_REQUIRE_BROWSER=1: pip install -e '.[test]'")
        pytest.skip("playwright is not installed: pip install -e '.[test]' to run the browser tests")
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox"])
        yield chromium
        chromium.close()

