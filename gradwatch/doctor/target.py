"""Doctor targets: the ``(model, batch, loss_fn)`` contract, and loading ``path.py:factory`` / ``module:factory``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradwatch.doctor.results import NAME_CAP, LossFn
from gradwatch.errors import ConfigError
from gradwatch.step.origin import tensors


# ---------------------------------------------------------------------------------------------- the contract
def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__


def _names(names: Sequence[str], cap: int = NAME_CAP) -> str:
    """Names joined by commas, at most ``cap`` of them, then how many more."""
    shown = ", ".join(names[:cap])
    return shown + (f" ... and {len(names) - cap} more" if len(names) > cap else "")


def _describe(obj: object) -> str:
    if obj is None:
        return "None"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} item{'s' * (len(obj) != 1)}"
    name = type(obj).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def validate_batch(batch: object, where: str = "batch") -> None:
    """Check that a batch is a tensor or a (nested) tuple, list or mapping of tensors.

    Raises:
        ConfigError: naming the first offending element, e.g. ``batch[1]['mask'] is a str``.
    """
    if isinstance(batch, torch.Tensor):
        return
    if isinstance(batch, Mapping):
        for key, value in batch.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where} has a key {key!r}; dict keys must be strings (they are keyword arguments)")
            validate_batch(value, f"{where}[{key!r}]")
        return
    if isinstance(batch, (tuple, list)):
        for i, value in enumerate(batch):
            validate_batch(value, f"{where}[{i}]")
        return
    raise ConfigError(f"{where} is {_describe(batch)}; a batch holds tensors, in tuples, lists or dicts")


def validate(model: object, batch: object, loss_fn: object) -> None:
    """Check ``(model, batch, loss_fn)`` against the contract of the module docstring.

    Raises:
        ConfigError: the first violation, in one line.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"the model is {_describe(model)}; it must be a torch.nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"the loss_fn is {_describe(loss_fn)}; it must be callable or None")
    validate_batch(batch)
    if not any(True for _ in tensors(batch)):
        raise ConfigError("the batch holds no tensor")
    if loss_fn is not None and isinstance(batch, (tuple, list)) and len(batch) != 2:
        raise ConfigError(f"with a loss_fn the batch must be a pair (inputs, targets), a tensor or a dict of inputs; "
                          f"got {_describe(batch)}")


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {key: _map_tensors(value, fn) for key, value in batch.items()}
    items = [_map_tensors(value, fn) for value in batch]
    if isinstance(batch, tuple):
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    return items


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(x)`` for a tensor, ``model(*inputs)`` for a tuple or list, ``model(**inputs)`` for a mapping."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def compute_loss(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The scalar loss of one batch, by the contract of the module docstring.

    Raises:
        ConfigError: the loss is not a scalar floating tensor, or (without a loss_fn) the output carries no loss.
    """
    if loss_fn is None:
        loss = _loss_of_output(call_model(model, batch))
    elif isinstance(batch, (tuple, list)):
        inputs, targets = batch
        loss = loss_fn(call_model(model, inputs), targets)
    else:
        loss = loss_fn(call_model(model, batch))
    where = "without a loss_fn the loss is the model's output, which" if loss_fn is None else "loss_fn"
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"{where} gave {_describe(loss)} as the loss; it must be a scalar tensor")
    if loss.numel() != 1 or not loss.is_floating_point():
        raise ConfigError(f"{where} gave a {loss.dtype} tensor of shape {tuple(loss.shape)} as the loss; it must be "
                          "a floating-point scalar (reduce it, e.g. with .mean())")
    return loss.reshape(())


def _loss_of_output(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None:
        raise ConfigError(f"without a loss_fn the model must return the loss (a scalar tensor) or an output with "
                          f".loss; it returned {_describe(output)}")
    return loss


# ------------------------------------------------------------------------------------------ loading a target
def load_target(target: str) -> tuple[nn.Module, Any, LossFn | None]:
    """Import ``path/to/script.py:factory`` or ``package.module:factory`` and call the factory.

    A script is imported from its file, with its directory on ``sys.path``; a module with
    ``importlib.import_module``, with the current directory on ``sys.path`` (as ``python -m`` does).
    The path entry is removed again once the factory has returned. ``factory`` may be dotted
    (``module:Class.build``). The factory is called with no arguments and must return
    ``(model, batch, loss_fn)``.

    Raises:
        ConfigError: the target cannot be parsed, imported or called, or returns something else (one line).
    """
    location, sep, attr = target.rpartition(":")
    if not sep or not location or not attr:
        raise ConfigError(f"target {target!r} must be path/to/script.py:factory or package.module:factory")
    is_path = location.endswith(".py") or "/" in location or os.sep in location
    folder = Path(location).resolve().parent if is_path else Path.cwd()
    with _on_sys_path(folder):
        module = _import_file(location) if is_path else _import_module(location)
        factory = _resolve(module, attr, location)
        try:
            made = factory()
        except (Exception, SystemExit) as exc:
            raise ConfigError(f"factory {target!r} raised {_one_line(exc)}") from None
    if not isinstance(made, (tuple, list)) or len(made) != 3:
        raise ConfigError(f"factory {target!r} returned {_describe(made)}; it must return (model, batch, loss_fn)")
    model, batch, loss_fn = made
    try:
        validate(model, batch, loss_fn)
    except ConfigError as exc:
        raise ConfigError(f"factory {target!r}: {exc}") from None
    return model, batch, loss_fn


@contextmanager
def _on_sys_path(folder: Path) -> Iterator[None]:
    entry = str(folder)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def _import_file(location: str) -> Any:
    path = Path(location)
    if not path.is_file():
        raise ConfigError(f"no such file: {location!r}" if not path.exists() else f"not a file: {location!r}")
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    name = f"gradwatch_doctor_target_{stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {location!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise ConfigError(f"importing {location!r} raised {_one_line(exc)}") from None
    return module


def _import_module(location: str) -> Any:
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as exc:
        if exc.name and (location == exc.name or location.startswith(exc.name + ".")):
            raise ConfigError(f"no module named {exc.name!r} (looked on sys.path and in the current directory; "
                              "a script needs its .py path)") from None
        raise ConfigError(f"importing {location!r} raised {_one_line(exc)}") from None
    except (Exception, SystemExit) as exc:
        raise ConfigError(f"importing {location!r} raised {_one_line(exc)}") from None


def _resolve(module: Any, attr: str, location: str) -> Callable[[], Any]:
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            offered = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                             and getattr(v, "__module__", None) == module.__name__)
            hint = f" (it defines: {_names(offered)})" if offered else ""
            raise ConfigError(f"{location!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{location}:{attr} is {_describe(obj)}, not a callable factory")
    return obj  # type: ignore[no-any-return]
