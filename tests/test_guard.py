"""One guard for every entry point from torch into gradwatch (issue 26, item 2).

No module but ``gradwatch.watching.register`` hands a callable to torch, and it takes guarded hooks only;
at run time every callable of gradwatch's that torch holds is a guard ``Hook``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.optim import optimizer as torch_optim

import gradwatch as gw
from gradwatch.watching import guard, register

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*sorted((ROOT / "gradwatch").rglob("*.py")), *sorted((ROOT / "integrations").rglob("*.py"))]

#: calls that hand a callable to torch or to the interpreter
REGISTERING = {
    "register_forward_pre_hook", "register_forward_hook", "register_full_backward_hook",
    "register_full_backward_pre_hook", "register_backward_hook", "register_hook", "register_post_accumulate_grad_hook",
    "register_step_pre_hook", "register_step_post_hook", "register_optimizer_step_pre_hook",
    "register_optimizer_step_post_hook", "register_module_forward_hook", "register_module_forward_pre_hook",
    "register_module_full_backward_hook", "register_module_full_backward_pre_hook", "queue_callback",
    "register_multi_grad_hook", "Thread", "signal", "register_at_fork",
    "register_module_module_registration_hook", "register_module_parameter_registration_hook",
    "register_module_buffer_registration_hook",
}
#: modules that register hooks for the length of one call of gradwatch's own (a replay, a doctor run,
#: which run inside a guarded hook or a CLI command and remove them before they return), or a thread
#: that serves HTTP (its failure never reaches training)
ALLOWED = {
    "gradwatch/watching/register.py": "the one door",
    "gradwatch/rootcause/nodes.py": "a replay's hooks, removed before it returns",
    "gradwatch/rootcause/locate.py": "a replay's hooks, removed before it returns",
    "gradwatch/rootcause/ops.py": "a replay's hooks, removed before it returns",
    "gradwatch/doctor/context.py": "the doctor's own forward pass, outside any training",
    "integrations/prometheus.py": "the metrics HTTP server's thread",
    "dashboards/server.py": "the dashboard's HTTP server's thread",
}


def _registrations(path: Path) -> list[str]:
    """The registering calls, ``atexit.register`` calls and ``sys.excepthook`` assignments of a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
            if name in REGISTERING and not (name == "signal" and owner != "signal") or (owner, name) == (
                    "atexit", "register"):
                found.append(f"{owner + '.' if owner else ''}{name} (line {node.lineno})")
            if name == "Hook" and path.name != "guard.py":
                found.append(f"Hook(...) made outside the guard (line {node.lineno})")
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr in ("excepthook", "exit"):
                    found.append(f"{target.attr} assigned (line {node.lineno})")
    return found


def test_the_checker_sees_each_way_of_registering(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import atexit, sys, threading\nm.register_forward_hook(f)\nt.register_hook(f)\n"
                      "engine.queue_callback(f)\nthreading.Thread(target=f)\natexit.register(f)\n"
                      "sys.excepthook = f\nHook(g, 'forward', f)\nsignal.signal(signal.SIGTERM, f)\nsys.exit = f\n")
    assert len(_registrations(sample)) == 9


@pytest.mark.parametrize("path", [p for p in SOURCES if str(p.relative_to(ROOT)) not in ALLOWED],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_register_module_hands_callables_to_torch(path: Path) -> None:
    found = _registrations(path)
    assert not found, (f"{path.relative_to(ROOT)} registers callables itself: {found}; register guarded hooks "
                       "through gradwatch.watching.register (every entry point from torch runs through the guard)")


def test_a_raw_callable_is_refused() -> None:
    with pytest.raises(TypeError, match="only guarded hooks"):
        register.forward(nn.Linear(2, 2), lambda *args: None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="only guarded hooks"):
        register.backward_end(print)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown hook kind"):
        guard.Guard(lambda exc: None).hook("not_a_kind", print)


def _ours(call: Any) -> bool:
    """Whether a callable torch holds leads into gradwatch (a function, a bound method or a partial of one)."""
    while hasattr(call, "func"):
        call = call.func
    target = getattr(call, "__self__", None) or call
    module = getattr(type(target) if hasattr(call, "__self__") else call, "__module__", "") or ""
    return module.startswith(("gradwatch", "integrations"))


def _held(model: nn.Module) -> list[Any]:
    """Every callable torch holds for this model: its modules', parameters' and the global hooks."""
    dicts = [getattr(m, name) for m in model.modules() for name in (
        "_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")]
    dicts += [p._post_accumulate_grad_hooks or {} for p in model.parameters()]
    dicts += [p._backward_hooks or {} for p in model.parameters()]
    dicts += [torch_module._global_forward_pre_hooks, torch_module._global_forward_hooks,
              torch_optim._global_optimizer_pre_hooks, torch_optim._global_optimizer_post_hooks]
    return [hook for hooks in dicts for hook in hooks.values()]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile(watch(m))"])
def test_every_callable_of_gradwatch_that_torch_holds_is_a_guarded_hook(tmp_path: Path, compiled: bool) -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    gw.watch(model, run=tmp_path / "run", console=False, sample_every=1)  # origin tracking and activations on
    run = torch.compile(model, backend="eager") if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[Any] = []
    for _ in range(3):
        loss = run(torch.randn(8, 4)).pow(2).mean()
        seen += _held(model)  # mid-iteration: the sampled step's leaf hooks are in
        opt.zero_grad()
        loss.backward()
        opt.step()
    ours = [hook for hook in seen if _ours(hook) or isinstance(hook, guard.Hook)]
    assert ours, "gradwatch's hooks were found"
    raw = [hook for hook in ours if not isinstance(hook, guard.Hook) and hook not in (
        register._DISPATCH.step_pre, register._DISPATCH.step_post)]
    assert not raw, f"callables of gradwatch's that torch holds outside the guard: {raw}"
    kinds = {hook.kind for hook in ours if isinstance(hook, guard.Hook)}
    assert {"forward_pre", "forward", "sentinel_grad", "accumulated"} <= kinds
    assert compiled or "activation" in kinds
    gw.unwatch(model)
    assert not [hook for hook in _held(model) if _ours(hook) or isinstance(hook, guard.Hook)], "every hook removed"
