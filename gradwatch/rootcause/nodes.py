"""Nodes (judge stage, rare path): the autograd node whose gradient went NaN/Inf from a finite one,
and the forward line that created it.

During the second replay of the anomalous step, a ``TorchFunctionMode`` (with :class:`~gradwatch.
rootcause.ops.Ops` recording the aten ops) runs only inside the origin module's calls and notes,
for every autograd node created there, the torch function, the aten op, the source line and
the inputs. The replayed backward then has a hook on each of those nodes (and only those): the
first one to run whose incoming gradients are finite and whose outgoing ones are not gave birth.
A non-finite gradient that goes (through casts, transposes, views) to a parameter names it: a
weight gradient ``input^T @ grad_output`` overflowing while the input gradient stays finite.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gradwatch.rootcause import facts
from gradwatch.rootcause.capture import Capture
from gradwatch.rootcause.frames import Line, user_line
from gradwatch.rootcause.locate import Located, output_grad
from gradwatch.rootcause.ops import Born, Ops
from gradwatch.rootcause.state import Rng, finite, first_tensor, has_nan, tensors

#: nodes that only move a gradient along (a parameter behind them is the one the gradient is for)
_PASS = re.compile(r"^(T|Transpose|Permute|View|Reshape|Unsafe\w*View|Expand|ToCopy|Clone|Squeeze\w*|Unsqueeze\w*"
                   r"|Alias|Slice|Select|AsStrided|Contiguous)Backward\d*$")


@dataclass
class Made:
    """How an autograd node was made in forward."""

    func: str
    op: str
    line: Line | None
    inputs: tuple[Any, ...]


def _snake(node: str) -> str:
    base = re.sub(r"Backward\d*$", "", node)
    return re.sub(r"(?<!^)(?=[A-Z])", "_", base).lower()


def aten_name(node: str, ran: list[str]) -> str:
    """The aten op behind a node: the op of the call whose name matches the node's (``SoftmaxBackward0``
    and ``_softmax``), else the call's last op, else the node's own name in snake case.
    """
    want = _snake(node)
    for name in ran:
        if name.lstrip("_") == want.lstrip("_"):
            return f"aten::{name}"
    return f"aten::{ran[-1]}" if ran else f"aten::{want}"


class Maker(TorchFunctionMode):
    """Notes how each autograd node created under it was made."""

    def __init__(self, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.made: dict[torch.autograd.graph.Node, Made] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        start = len(self.ops.names)
        out = func(*args, **(kwargs or {}))
        for t in tensors(out):
            node = t.grad_fn
            if node is not None and node not in self.made:
                name = getattr(func, "__name__", str(func))
                self.made[node] = Made(name, aten_name(node.name(), self.ops.names[start:]), user_line(), args)
        return out


def _param_of(node: Any, index: int, params: dict[int, str]) -> str | None:
    """The parameter that gradient ``index`` of ``node`` flows to, through nodes that only move it."""
    nxt = node.next_functions[index][0] if index < len(node.next_functions) else None
    for _ in range(16):
        if nxt is None:
            return None
        var = getattr(nxt, "variable", None)
        if var is not None:
            return params.get(id(var))
        if not _PASS.match(nxt.name()) or not nxt.next_functions:
            return None
        nxt = nxt.next_functions[0][0]
    return None


def _row_scores(made: Made, grad_outputs: tuple[Any, ...]) -> torch.Tensor | None:
    """How much each row of a matrix product's input puts into its weight gradient: ``|x_b| |g_b|``
    (exact for 2-D inputs, a bound for more dimensions), in float64; None for other ops.
    """
    if made.func not in ("linear", "addmm", "matmul", "mm", "__matmul__"):
        return None
    mat = made.inputs[1] if made.func == "addmm" and len(made.inputs) > 2 else made.inputs[0]
    grad = next((t for t in grad_outputs if isinstance(t, torch.Tensor)), None)
    if not isinstance(mat, torch.Tensor) or grad is None or mat.dim() == 0 or grad.dim() == 0 \
            or mat.shape[0] != grad.shape[0]:
        return None
    with torch.no_grad():
        x = mat.detach().double().reshape(mat.shape[0], -1).norm(dim=1)
        gr = grad.detach().double().reshape(grad.shape[0], -1).norm(dim=1)
        return (x * gr.to(x.device)).cpu()


def search(model: nn.Module, cap: Capture, located: Located, rng: Rng) -> tuple[Born | None, dict[str, Any]]:
    """Replay the forward call and its backward again, watching the nodes made inside the origin module.

    Returns:
        the node's op (None when no node there gave birth), and the origin module's last call
        (``args``, ``kwargs``, ``rng``) for the precision replay.
    """
    assert located.module is not None
    target = located.module
    layer = located.name
    params = {id(p): n for n, p in model.named_parameters()}
    ops = Ops(check=False)
    maker = Maker(ops)
    call: dict[str, Any] = {}

    def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
        call.update(args=args, kwargs=kwargs, rng=rng.get())
        ops.__enter__()
        maker.__enter__()

    def post(module: nn.Module, args: Any, output: Any) -> None:
        maker.__exit__(None, None, None)
        ops.__exit__(None, None, None)

    handles = [target.register_forward_pre_hook(pre, with_kwargs=True), target.register_forward_hook(post)]
    try:
        rng.set(cap.rng)
        with cap.autocast.applied(), torch.enable_grad():
            output = model(*cap.args, **cap.kwargs)
    finally:
        for h in handles:
            h.remove()
    out = first_tensor(output)
    if out is None or not out.requires_grad or not maker.made:
        return None, call
    grad, _ = output_grad(cap, out)
    if grad is None:
        return None, call
    found: list[Born] = []

    def watch(node: Any, made: Made) -> Any:
        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            if found or not finite(grad_outputs) or finite(grad_inputs):
                return
            bad = [i for i, gi in enumerate(grad_inputs) if gi is not None and not finite(gi)]
            param = next((p for p in (_param_of(node, i, params) for i in bad) if p is not None), None)
            rows = next((grad_inputs[i] for i in bad if _param_of(node, i, params) is None), None)
            fact = facts.backward(node.name(), made.op.removeprefix("aten::"), made.func, made.inputs,
                                  grad_outputs, param)
            found.append(Born(op=made.op, phase="backward", layer=layer, what="NaN" if has_nan(grad_inputs) else "Inf",
                              fact=fact, line=made.line, rows=rows, node=node.name(), param=param,
                              scores=_row_scores(made, grad_outputs) if param is not None else None))
        return node.register_hook(hook)

    hooks = [watch(node, made) for node, made in maker.made.items()]
    try:
        wanted = [p for p in model.parameters() if p.requires_grad]
        torch.autograd.grad(out, wanted, grad_outputs=grad, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    return (found[0] if found else None), call

