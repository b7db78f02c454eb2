"""Observed values: the scalars a loop reports for its step (``observe``), read with the step's one host read."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch

#: name -> the values observed under it since the last step (numbers, or 0-d tensors on the device)
Observed = dict[str, list[Any]]

#: what gradwatch measures itself: observing it would overwrite the measurement
RESERVED = ("grad_norm", "amp_scale", "clip_coef", "closure_evaluations")


def validated(name: str, value: Any) -> Any:
    """``value`` as kept until the step: a detached 0-d tensor or a real number.

    Raises:
        ValueError: a reserved name, a tensor with more than one element, or a number too large
            for a float.
        TypeError: neither a number nor a tensor.
    """
    if name in RESERVED:
        raise ValueError(f"observe({name}=...): {name!r} is measured by gradwatch itself and cannot be observed; "
                         f"use another name (e.g. {'my_' + name!r}; a norm before your own clipping is "
                         "'grad_norm_preclip')")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"observe({name}=...) needs a scalar, got a tensor of shape {tuple(value.shape)}")
        return value.detach().reshape(())
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"observe({name}=...) needs a number or a one-element tensor, got {type(value).__name__}")
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"observe({name}=...) got a number too large for a float ({str(value)[:20]}...)") from None
    return value


def device_parts(observed: Observed) -> list[torch.Tensor]:
    """The observed values still on the device, read with the step's host read."""
    return [v for values in observed.values() for v in values if isinstance(v, torch.Tensor)]


def scalars(observed: Observed, host: np.ndarray) -> dict[str, float]:
    """One number per name (the mean of its values); ``host`` holds the :func:`device_parts`, in order."""
    out, k = {}, 0
    for name, values in observed.items():
        nums = []
        for v in values:
            if isinstance(v, torch.Tensor):
                nums.append(float(host[k]))
                k += 1
            else:
                nums.append(float(v))
        out[name] = sum(nums) / len(nums)
    return out


def merge(earlier: Observed, later: Observed) -> Observed:
    """Both iterations' values, ``earlier``'s first (a gradient-accumulation micro-batch joins its step)."""
    for name, values in later.items():
        earlier.setdefault(name, []).extend(values)
    return earlier
