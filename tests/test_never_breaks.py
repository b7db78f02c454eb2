"""gradwatch never breaks the loop it watches (issue 26, item 2).

Every entry point from torch into gradwatch is made to raise in turn (the kinds the loop reaches,
found at run time), in a real loop, eager and compiled in both orders, with a GradScaler and
gradient accumulation: training completes, one InternalWarning says so, and the weights are
bit-identical to an unwatched run's (rules=None: watching never changes training).

nanoGPT's order — ``model = torch.compile(model)`` then ``gw.watch(model)`` — with a GradScaler:
the compiled graph returns the loss beside the logits, so the backward pass gives the logits no
gradient (autograd's None) and the hook on them must take that in its stride.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradwatch as gw
from gradwatch.watching import guard

from . import pool

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch")


class Root(nn.Module):
    """``sqrt`` of a layer's activations; zeroed on the planted step: finite forward, Inf in backward."""

    planted = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(h * 0 if self.planted else h)


class TinyGPT(nn.Module):
    """nanoGPT's interface: ``model(idx, targets)`` returns ``(logits, loss)``, the loss computed inside."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.fc = nn.Linear(width, width)
        self.root = Root()
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        logits = self.head(self.root(F.relu(self.fc(self.wte(idx)))))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def _train(run: Path, *, compiled: bool, scaler: bool, planted_at: int | None = None,
           steps: int = 6) -> tuple[list[warnings.WarningMessage], TinyGPT]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    base = TinyGPT()
    model = torch.compile(base, backend="aot_eager") if compiled else base
    model = gw.watch(model, run=run, rules=None, console=False)  # nanoGPT: compile first, then watch
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
    amp = torch.amp.GradScaler("cpu", enabled=scaler)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            idx = torch.randint(0, 32, (4, 8), generator=gen)
            base.root.planted = step == planted_at
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaler):
                _, loss = model(idx, targets=idx)
            amp.scale(loss).backward()
            gw.watcher(model).observe(loss=loss)
            amp.step(opt)
            amp.update()
            opt.zero_grad(set_to_none=True)
        gw.unwatch(model)
    return [w for w in caught if issubclass(w.category, gw.GradwatchWarning)], base


@pytest.mark.slow  # compiles the model (aot_eager)
def test_nanogpt_order_with_a_gradscaler_trains_watched(tmp_path: Path) -> None:
    caught, _ = _train(tmp_path / "run", compiled=True, scaler=True)
    assert not [str(w.message) for w in caught if issubclass(w.category, gw.InternalWarning)]
    with gw.open_run(tmp_path / "run") as run:
        assert run.status == "finished" and run.steps == 6


@pytest.mark.slow  # compiles the model (aot_eager)
def test_a_nan_born_in_backward_is_named_alike_in_nanogpt_order_and_eager(tmp_path: Path) -> None:
    found = {}
    for compiled in (False, True):
        run = tmp_path / f"compiled{compiled}"
        caught, _ = _train(run, compiled=compiled, scaler=False, planted_at=3)
        assert not [str(w.message) for w in caught if issubclass(w.category, gw.InternalWarning)]
        with gw.open_run(run) as stored:
            rows = stored.findings()
        first = rows[rows["kind"] == "nonfinite"].iloc[0]
        found[compiled] = (int(first["step"]), first["layer"], first["phase"], first["data"]["root_cause"]["op"])
    assert found[False] == (3, "root", "backward", "aten::sqrt")
    assert found[True] == found[False], "the compiled model's NaN is named where the eager one's is"


# ------------------------------------------------------ fault injection
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        out = self.fc2(torch.tanh(self.norm(self.fc1(x))))
        return out if y is None else (out, F.mse_loss(out, y))


#: configuration -> (how the model is compiled, with which backend; GradScaler; micro-batches per step)
CONFIGS = {
    "eager": (None, "", False, 1),
    "compile(watch(m))": ("outside", "eager", False, 1),
    "watch(compile(m))": ("inside", "eager", False, 1),
    "gradscaler": (None, "", True, 1),
    "accumulation": (None, "", False, 2),
    # nanoGPT's order, AOTAutograd: the output that returns beside the loss gets no gradient (None)
    "watch(compile(m))+gradscaler+accumulation": ("inside", "aot_eager", True, 2),
}
STEPS = 8


def _loop(run: Path | None, config: str, fault: str | None = None, after: int = 0
          ) -> tuple[dict[str, torch.Tensor], list[str], dict[str, int]]:
    """Train ``STEPS`` steps (watched into ``run`` unless None), ``fault`` raising at its ``after + 1``-th
    call; returns the final weights, the InternalWarnings and the calls of each hook kind.
    """
    compiled, backend, scaled, micro = CONFIGS[config]
    torch.manual_seed(0)
    torch._dynamo.reset()
    base = Net()
    model: nn.Module = torch.compile(base, backend=backend) if compiled == "inside" else base
    if run is not None:
        model = gw.watch(model, run=run, rules=None, console=False, sample_every=3)
    if compiled == "outside":
        model = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=scaled)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught, guard.inject(fault, after=after) as calls:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            for _ in range(micro):
                x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
                with torch.autocast("cpu", dtype=torch.float16, enabled=scaled):
                    _, loss = model(x, y)
                scaler.scale(loss / micro).backward()
                if run is not None:
                    gw.watcher(base).observe(loss=loss)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        entered = dict(calls)
    if run is not None:
        gw.unwatch(base)
    internal = [str(w.message) for w in caught if issubclass(w.category, gw.InternalWarning)]
    return {k: v.detach().clone() for k, v in base.state_dict().items()}, internal, entered


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # a dozen short runs per configuration (compiled ones recompile each time)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_failure_in_any_entry_point_detaches_gradwatch_and_training_goes_on_unchanged(
        tmp_path: Path, config: str) -> None:
    reference, _, _ = _loop(None, config)
    watched, internal, calls = _loop(tmp_path / "watched", config)  # every kind the loop reaches, counted
    assert not internal and _same(watched, reference), "watched with rules=None, the weights are the unwatched ones"
    assert {"forward_pre", "sentinel_grad", "accumulated", "backward_end", "step_pre", "step_post"} <= calls.keys()
    failures = []
    # a run per kind, failing mid-run; independent of each other, they train in the tests' pool of two processes
    runs = {kind: pool.submit(_loop, tmp_path / kind, config, kind, count // 2)
            for kind, count in sorted(calls.items())}
    for kind, future in runs.items():
        weights, internal, _ = pool.result(future)
        with gw.open_run(tmp_path / kind) as stored:  # the run is readable: what was recorded until the failure
            status, steps = stored.status, stored.steps
        if len(internal) != 1 or "fault injected" not in internal[0]:
            failures.append(f"{kind}: {len(internal)} InternalWarnings {internal}")
        elif not _same(weights, reference):
            failures.append(f"{kind}: the weights differ from the unwatched run's")
        elif status != "crashed" or steps > STEPS:
            failures.append(f"{kind}: the run reads as {status} with {steps} steps")
    assert not failures, "\n".join(failures)


# ------------------------------------------------- DDP, 2 ranks on gloo
def _ddp_phase(rank: int, run: str | None, fault: str | None, after: int) -> tuple[list[float], int, dict[str, int]]:
    """One DDP training on this rank (watched into ``run`` unless None; ``fault`` injected on rank 1)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = DistributedDataParallel(model)
    if run is not None:
        gw.watch(ddp, run=run, rules=None, console=False, sample_every=3)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    with warnings.catch_warnings(record=True) as caught, \
            guard.inject(fault if rank == 1 else None, after=after) as calls:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            loss = F.mse_loss(ddp(torch.randn(16, 8, generator=gen)), torch.randn(16, 1, generator=gen))
            opt.zero_grad()
            loss.backward()
            if run is not None:
                gw.watcher(ddp).observe(loss=loss)
            opt.step()
        entered = dict(calls)
    if run is not None:
        gw.unwatch(ddp)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return weights, sum(issubclass(w.category, gw.InternalWarning) for w in caught), entered


def ddp_worker(rank: int, port: int, out: str) -> None:
    """Both ranks: an unwatched reference, a watched run, then a run per hook kind failing on rank 1."""
    import json
    import os
    import traceback

    import torch.distributed as dist

    from tests.ranks import leave_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: dict[str, Any] = {"rank": rank, "faults": {}}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2)
        result["reference"], _, _ = _ddp_phase(rank, None, None, 0)
        weights, internal, calls = _ddp_phase(rank, str(Path(out) / "watched"), None, 0)
        result["watched"] = (weights, internal)
        kinds = [sorted(calls.items())]
        dist.broadcast_object_list(kinds, src=1)  # rank 1's kinds, the same list on both ranks
        for kind, count in kinds[0]:
            result["faults"][kind] = _ddp_phase(rank, str(Path(out) / kind), kind, count // 2)[:2]
        dist.barrier()
    except BaseException:
        result["error"] = traceback.format_exc()
    finally:
        leave_group()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow  # two real processes on gloo, a dozen short runs
def test_a_failure_on_one_rank_in_any_entry_point_leaves_ddp_training_unchanged(tmp_path: Path) -> None:
    from tests.ranks import spawn_ranks

    results = spawn_ranks(ddp_worker, (str(tmp_path),), tmp_path, timeout=240, world=2)
    for r in results:
        assert r["watched"] == [r["reference"], 0], "watched with rules=None, DDP trains as unwatched"
    kinds = set(results[1]["faults"])
    assert {"forward_pre", "sentinel_grad", "accumulated", "backward_end", "step_pre", "step_post"} <= kinds
    failures = [f"rank {r['rank']}, {kind}: {internal} InternalWarnings" + ("" if weights == r["reference"] else
                                                                             ", the weights differ")
                for r in results for kind, (weights, internal) in r["faults"].items()
                if internal != 1 or weights != r["reference"]]
    assert not failures, "\n".join(failures)
    for kind in kinds:
        with gw.open_run(tmp_path / kind) as stored:
            assert stored.status == "crashed" and stored.steps <= STEPS, kind


# ------------------------------------ entry points outside the plain loop
def _closure_loop(run: Path | None, fault: str | None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """L-BFGS, which evaluates ``optimizer.step(closure)``'s closure itself (watched into ``run`` unless None)."""
    torch.manual_seed(0)
    model = Net()
    if run is not None:
        gw.watch(model, run=run, rules=None, console=False)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught, guard.inject(fault, after=2):
        warnings.simplefilter("always")
        for _ in range(5):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = model(x, y)[1]
                loss.backward()
                return loss

            opt.step(closure)
    if run is not None:
        gw.unwatch(model)
    return {k: v.clone() for k, v in model.state_dict().items()}, [
        str(w.message) for w in caught if issubclass(w.category, gw.InternalWarning)]


@pytest.mark.parametrize("kind", ["closure", "step_pre", "backward_end"])
def test_a_failure_while_the_optimizer_evaluates_the_closure_changes_nothing(tmp_path: Path, kind: str) -> None:
    reference, _ = _closure_loop(None, None)
    weights, internal = _closure_loop(tmp_path / "run", kind)
    assert len(internal) == 1 and "fault injected" in internal[0], internal
    assert _same(weights, reference)


def test_a_failure_at_the_first_forward_of_a_watched_class_leaves_it_unwatched(tmp_path: Path) -> None:
    @gw.watch(run=tmp_path / "run", rules=None, console=False)
    class Watched(Net):
        pass

    torch.manual_seed(0)
    model = Watched()
    with warnings.catch_warnings(record=True) as caught, guard.inject("first_forward"):
        warnings.simplefilter("always")
        out, loss = model(torch.randn(4, 8), torch.randn(4, 1))
        loss.backward()
    internal = [str(w.message) for w in caught if issubclass(w.category, gw.InternalWarning)]
    assert len(internal) == 1 and "fault injected" in internal[0], internal
    assert not model._forward_pre_hooks, "the first-forward hook is gone"
