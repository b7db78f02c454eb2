"""Facts (judge stage, rare path): what about an op's inputs explains the NaN/Inf it produced.

Each fact is one clause for people ("3 of the input's 48 values are negative (min -0.418)"),
computed from the op's own inputs during the replay. The common culprits have their own: log
and sqrt of negative or zero values, division by zero, softmax over an all ``-inf`` row, exp
and pow overflow, the norm's and sqrt's gradients at zero, overflow of float16's range
(|x| > 65504) and the weight gradient ``input^T @ grad_output`` overflowing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradwatch.rootcause.state import LOW_PRECISION, stored


def g(v: float) -> str:
    """A number in 3 significant digits."""
    return f"{v:.3g}"


def _count(mask: torch.Tensor) -> int:
    return int(mask.sum())


_INPUT = "the input's"


def _of(k: int, n: int, what: str, owner: str = "its") -> str:
    """``1 of its 8 inputs is`` / ``3 of the input's 8 values are``."""
    return f"{k:,} of {owner} {n:,} {what} {'is' if k == 1 else 'are'}"


def _tensor(args: Sequence[Any], i: int = 0) -> torch.Tensor | None:
    t = args[i] if len(args) > i else None
    return t if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) else None


def _names(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _index(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def _log(args: Sequence[Any], low: float = 0.0) -> str | None:
    x = _tensor(args)
    if x is None:
        return None
    neg, zero, n = _count(x < low), _count(x == low), x.numel()
    parts = []
    if neg:
        parts.append(f"{_of(neg, n, 'values', _INPUT)} {'negative' if low == 0 else f'below {low:g}'} "
                     f"(min {g(float(x.min()))})")
    if zero:
        parts.append(f"{_of(zero, n, 'values', _INPUT)} exactly {low:g} (log 0 = -inf)")
    return "; ".join(parts) or None


def _sqrt(args: Sequence[Any]) -> str | None:
    x = _tensor(args)
    if x is None:
        return None
    neg, n = _count(x < 0), x.numel()
    return f"{_of(neg, n, 'values', _INPUT)} negative (min {g(float(x.min()))})" if neg else None


def _rsqrt(args: Sequence[Any]) -> str | None:
    x = _tensor(args)
    if x is None:
        return None
    zero = _count(x == 0)
    return _sqrt(args) or (f"{_of(zero, x.numel(), 'values', _INPUT)} exactly 0 (1/sqrt(0) = inf)"
                           if zero else None)


def _div(args: Sequence[Any]) -> str | None:
    b = args[1] if len(args) > 1 else None
    a = _tensor(args)
    if isinstance(b, (int, float)):
        return "divides by the constant 0" if b == 0 else None
    if not isinstance(b, torch.Tensor):
        return None
    zero = b == 0
    k = _count(zero)
    if not k:
        return None
    text = f"the divisor is 0 in {k:,} of its {b.numel():,} values"
    if a is not None:
        both = _count(torch.broadcast_to(zero, torch.broadcast_shapes(a.shape, b.shape)) & (a == 0))
        if both:
            text += f" (0/0 in {both:,})"
    return text


def _reciprocal(args: Sequence[Any]) -> str | None:
    x = _tensor(args)
    k = _count(x == 0) if x is not None else 0
    return f"{_of(k, x.numel(), 'values', _INPUT)} exactly 0 (1/0 = inf)" if x is not None and k else None


def _softmax(args: Sequence[Any]) -> str | None:
    x = _tensor(args)
    if x is None or x.dim() == 0:
        return None
    dim = int(args[1]) % x.dim() if len(args) > 1 and isinstance(args[1], int) else x.dim() - 1
    rows = (x == -math.inf).all(dim=dim)
    k = _count(rows)
    if k:
        first = _index(int(torch.nonzero(rows.flatten())[0]), rows.shape)
        where = "row " + (str(first[0]) if len(first) == 1 else str(list(first)))
        more = f" ({k:,} rows in all)" if k > 1 else ""
        return f"{where} of the input is all -inf (every position masked){more}: softmax over it is 0/0"
    if _count(x == math.inf):
        return f"the input holds +inf in {_count(x == math.inf):,} places: inf - inf = NaN"
    return None


def _exp(args: Sequence[Any], out: torch.Tensor, base: float = math.e) -> str | None:
    x = _tensor(args)
    if x is None:
        return None
    limit = math.log(torch.finfo(out.dtype).max) / math.log(base)
    top = float(x.max())
    if top <= limit:
        return None
    name = "exp" if base == math.e else "exp2"
    return (f"{name} of values up to {g(top)} overflows {_names(out.dtype)} ({name}(x) > "
            f"{g(torch.finfo(out.dtype).max)} for x > {limit:.4g})")


def _pow(args: Sequence[Any], out: torch.Tensor) -> str | None:
    base, exp = args[0] if args else None, args[1] if len(args) > 1 else None
    if isinstance(base, torch.Tensor) and isinstance(exp, (int, float)):
        if exp != int(exp) and _count(base < 0):
            neg = _of(_count(base < 0), base.numel(), "bases", "the")
            return f"a negative base to the fractional power {exp:g}: {neg} negative (min {g(float(base.min()))})"
        if exp < 0 and _count(base == 0):
            return f"0 to the negative power {exp:g}: {_of(_count(base == 0), base.numel(), 'bases', 'the')} exactly 0"
        top = float(base.abs().max())
        if top > 0 and exp > 0 and exp * math.log(top) > math.log(torch.finfo(out.dtype).max):
            return f"|base|^{exp:g} overflows {_names(out.dtype)}: the largest |base| is {g(top)}"
    return None


def _cast(args: Sequence[Any], out: torch.Tensor) -> str | None:
    x = _tensor(args)
    if x is None or out.dtype not in LOW_PRECISION:
        return None
    top, limit = float(x.abs().max()), torch.finfo(out.dtype).max
    if top <= limit:
        return None
    return (f"values up to {g(top)} are cast to {_names(out.dtype)}, whose largest value is {g(limit)} "
            f"(|x| > {g(limit)} overflows)")


_FORWARD: dict[str, Callable[[Sequence[Any], torch.Tensor], str | None]] = {
    "log": lambda a, o: _log(a), "log2": lambda a, o: _log(a), "log10": lambda a, o: _log(a),
    "log1p": lambda a, o: _log(a, -1.0), "sqrt": lambda a, o: _sqrt(a), "rsqrt": lambda a, o: _rsqrt(a),
    "div": lambda a, o: _div(a), "true_divide": lambda a, o: _div(a), "reciprocal": lambda a, o: _reciprocal(a),
    "_softmax": lambda a, o: _softmax(a), "_log_softmax": lambda a, o: _softmax(a),
    "softmax": lambda a, o: _softmax(a), "log_softmax": lambda a, o: _softmax(a),
    "exp": _exp, "expm1": _exp, "exp2": lambda a, o: _exp(a, o, 2.0), "pow": _pow,
    "_to_copy": _cast, "to": _cast, "_autocast_to_reduced_precision": _cast,
}


#: ops whose NaN/Inf comes from one argument's value at a pole of the op (0 for log and a division's
#: divisor, a negative value for sqrt ...): that argument's position
POLES = {"log": 0, "log2": 0, "log10": 0, "log1p": 0, "sqrt": 0, "rsqrt": 0, "reciprocal": 0, "div": 1,
         "true_divide": 1, "pow": 0}


def weightless(op: str, args: Sequence[Any]) -> bool:
    """Whether the values that made an op's NaN/Inf carry no trainable weight: the argument at the
    op's pole (the divisor of a division, the input of a log), else every floating-point input, holds
    no gradient history (computed from the batch, constants and frozen weights alone).

    A pole that is a plain number (a division by the constant 0) is the code's, never the batch's.
    """
    at = POLES.get(op.rstrip("_"))
    if at is not None:
        culprit = args[at] if len(args) > at else None
        return isinstance(culprit, torch.Tensor) and not culprit.requires_grad
    ins = [a for a in args if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())]
    return bool(ins) and not any(a.requires_grad for a in ins)


def culprit(op: str, args: Sequence[Any]) -> str:
    """What in an op's inputs made its NaN/Inf, in a few words: ``a 0 in the divisor of the division``."""
    name = op.rstrip("_")
    at = POLES.get(name)
    x = args[at] if at is not None and len(args) > at and isinstance(args[at], torch.Tensor) else None
    if x is None or not x.is_floating_point():
        return f"values that `{op}` turns into NaN/Inf"
    if name in ("div", "true_divide"):
        return "a 0 in the divisor of the division"
    if name == "reciprocal":
        return "a 0 in the input of 1/x"
    if name == "pow":
        return "a 0 or negative base of pow"
    low = -1.0 if name == "log1p" else 0.0
    with torch.no_grad():
        zero, below = bool((x == low).any()), bool((x < low).any())
    value = {(True, False): f"a {low:g}", (False, True): f"a value below {low:g}" if low else "a negative value",
             (True, True): f"values of {low:g} and below" if low else "a 0 and negative values"}.get((zero, below))
    return f"{value or 'a value'} in the input of {name}"


def forward(op: str, func: Callable[..., Any] | None, args: Sequence[Any], kwargs: dict[str, Any],
            out: torch.Tensor) -> str:
    """Why an op with finite inputs returned NaN/Inf (``op`` without ``aten::`` and overload)."""
    with torch.no_grad():
        fact = _FORWARD[op.rstrip("_")](args, out) if op.rstrip("_") in _FORWARD else None
        if fact is None and out.dtype in LOW_PRECISION and func is not None:
            fact = _low_precision(func, args, kwargs, out)
        return fact or _ranges(args)


def _low_precision(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                   out: torch.Tensor) -> str | None:
    """The same op in float32: how far its result goes beyond the low-precision type's range."""
    def up(x: Any) -> Any:
        return x.float() if isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION else x

    try:
        again = func(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
    except Exception:  # an op that refuses float32 inputs: no fact
        return None
    again = again[0] if isinstance(again, (tuple, list)) else again
    if not isinstance(again, torch.Tensor) or not bool(torch.isfinite(again).all()):
        return None
    top, limit = float(again.abs().max()), torch.finfo(out.dtype).max
    if top <= limit:
        return None
    return (f"{_names(out.dtype)} overflow: in float32 its result reaches {g(top)}, beyond {_names(out.dtype)}'s "
            f"largest value {g(limit)} (|x| > {g(limit)} is inf)")


def _ranges(args: Sequence[Any]) -> str:
    ts = [stored(a) for a in args if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel()]
    ts = [t for t in ts if t.numel()]  # a sparse tensor's stored values
    if not ts:
        return "its inputs are finite"
    spans = ", ".join(f"[{g(float(t.min()))}, {g(float(t.max()))}]" for t in ts[:3])
    if not all(bool(torch.isfinite(t).all()) for t in ts):  # a NaN born of Inf: inf - inf, 0 x inf, inf / inf
        return f"its inputs hold Inf but no NaN (ranges {spans}): inf - inf, 0 x inf and inf / inf are NaN"
    return f"its inputs are finite (ranges {spans})"


def backward(node: str, op: str, func: str, inputs: Sequence[Any], grad_out: Sequence[torch.Tensor | None],
             param: str | None) -> str:
    """Why a backward node with a finite output gradient returned a NaN/Inf gradient.

    Args:
        node: the autograd node's name (``SqrtBackward0``).
        op: the forward aten op (``sqrt``).
        func: the torch function the forward called (``linear``, ``sqrt``).
        inputs: that call's arguments.
        grad_out: the gradients that arrived at the node (finite).
        param: the parameter whose gradient went non-finite, if it was a parameter's.
    """
    with torch.no_grad():
        x = _tensor(inputs)
        if op == "sqrt" and x is not None and _count(x == 0):
            return f"sqrt's gradient 1/(2·sqrt(x)) is infinite at x = 0: {_of(_count(x == 0), x.numel(), 'inputs')} 0"
        if "norm" in op and x is not None and x.dim() > 0:
            zero = (x == 0).all(dim=-1) if x.dim() > 1 else (x == 0).all().reshape(1)
            if _count(zero):
                return (f"the norm's gradient x/‖x‖ is 0/0 where the norm is 0: "
                        f"{_of(_count(zero), zero.numel(), 'vectors')} all zero")
        if op == "pow" and x is not None and len(inputs) > 1 and isinstance(inputs[1], (int, float)) \
                and 0 < inputs[1] < 1 and _count(x == 0):
            return (f"pow's gradient {inputs[1]:g}·x^({inputs[1]:g}-1) is infinite at x = 0: "
                    f"{_of(_count(x == 0), x.numel(), 'inputs')} exactly 0")
        if param is not None and op in ("addmm", "mm", "bmm", "matmul"):
            return _weight(inputs, grad_out, func)
        if op in ("div", "reciprocal") and len(inputs) > 1 and isinstance(inputs[1], torch.Tensor) \
                and _count(inputs[1] == 0):
            return f"the gradient of a/b is infinite where b = 0: the divisor is 0 in {_count(inputs[1] == 0):,} places"
        return _ranges(list(inputs) + [t for t in grad_out if t is not None])


def _weight(inputs: Sequence[Any], grad_out: Sequence[torch.Tensor | None], func: str) -> str:
    """The weight gradient of a matrix product, ``input^T @ grad_output``, recomputed in float64."""
    mat = inputs[1] if func == "addmm" and len(inputs) > 2 else inputs[0]
    g_out = next((t for t in grad_out if t is not None), None)
    if not isinstance(mat, torch.Tensor) or g_out is None:
        return _ranges(inputs)
    a, b = mat.double().reshape(-1, mat.shape[-1]), g_out.double().reshape(-1, g_out.shape[-1])
    if a.shape[0] != b.shape[0]:
        return _ranges(inputs)
    exact = float((a.T @ b).abs().max())
    dtype = g_out.dtype
    return (f"input^T @ grad_output overflows {_names(dtype)}: max |input| {g(float(a.abs().max()))} × max |grad| "
            f"{g(float(b.abs().max()))} summed over {a.shape[0]:,} rows reaches {g(exact)} "
            f"(largest {_names(dtype)}: {g(torch.finfo(dtype).max)})")
