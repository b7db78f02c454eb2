"""Calls (step stage): whether a forward call now is a step's own -- not a ``torch.func`` transform's, not
activation checkpointing's recomputation inside a backward pass.
"""

from __future__ import annotations

import torch

_FUNCTORCH = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)  # None: no transform


def transformed() -> bool:
    """Whether a ``torch.func`` transform runs the model now: no step's call; the hooks record nothing."""
    return _FUNCTORCH is not None and _FUNCTORCH() is not None


#: the backward pass running in this thread (-1: none), where torch tells it
_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)


def recomputing() -> bool:
    """Whether a forward call runs inside a backward pass: activation checkpointing recomputing a
    segment (``torch.utils.checkpoint``), whose outputs the forward may have measured already.
    """
    return _GRAPH_TASK is not None and _GRAPH_TASK() != -1
