"""The real-code zoo: small training scripts written the way widely copied public ones are.

Each module is one self-contained script in the style of a well-known public training program
(a nanoGPT-style GPT trainer, the classic word-language-model LSTM with hand-written SGD, a
Hugging Face ``Trainer`` run, a ResNet with BatchNorm, a VAE with a summed loss, a REINFORCE
policy-gradient loop), written for this repository on generated data. None imports another
project's code. Every script exposes a ``Config`` dataclass and a ``train(cfg) -> Result``:

* ``cfg.run`` is None for an unwatched run, or the run directory to watch it into (one
  ``gw.watch`` line, plus ``observe(loss=...)`` where the script has a loss), so that a test can
  compare losses watched and unwatched bit for bit;
* the ``Config`` fields after ``# plants`` put in the failures of issue 15 the way they happen
  in practice (a learning rate 100x too high, a parameter left out of the optimizer, a padding
  mask that hides a whole attention row ...); every plant defaults to off (a healthy run).

Scripts stay small enough that a run takes about a second on two CPU cores.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradwatch as gw
from gradwatch.rules import DEFAULT_RULES

Observe = Callable[..., None]

#: the default rules without their halts (of a run the learning rate wrecked, of a clip needed again and again:
#: issue 35): the watch options of the tests that follow such a run past its error (``tests/test_default_rules_stop.py``
#: tests the halts)
PAST_THE_HALT: dict[str, Any] = {"rules": [
    {"when": r.when, "do": r.do, **({"severity": r.severity} if r.severity else {}),
     **{k: v for k, v in r.params.items() if k not in ("max_clips", "within")}}
    for r in DEFAULT_RULES if r.do != "halt"]}


@dataclass
class Result:
    """What one training run produced."""

    losses: list[float]
    run: Path | None
    extra: dict[str, Any] = field(default_factory=dict)

    def findings(self) -> list[dict[str, Any]]:
        """The run's findings as plain dicts (NaN cells as None), in step order."""
        assert self.run is not None, "an unwatched run has no findings"
        with gw.open_run(self.run) as run:
            frame = run.findings()
        rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
                for row in frame.to_dict("records")]
        return sorted(rows, key=lambda f: f["step"])


def attach(model: Any, run: Path | None, **options: Any) -> Observe:
    """Watch ``model`` into ``run`` (nothing when ``run`` is None); the watcher's ``observe``."""
    if run is None:
        return lambda **scalars: None
    options.setdefault("console", False)
    gw.watch(model, run=run, **options)
    return gw.watcher(model).observe


def compiled_and_watched(model: Any, cfg: Any) -> tuple[Any, Observe]:
    """The module a loop calls and ``observe``: ``model`` watched into ``cfg.run`` (with ``cfg.watch``), or
    compiled with the aot_eager backend in the order ``cfg.compile`` names (``compile-watched``:
    ``torch.compile(gw.watch(model))``; ``watch-compiled``: ``gw.watch(torch.compile(model))``)."""
    import torch

    if cfg.compile is None:
        return model, attach(model, cfg.run, **cfg.watch)
    assert cfg.compile in ("compile-watched", "watch-compiled"), cfg.compile
    if cfg.compile == "watch-compiled":
        net = torch.compile(model, backend="aot_eager")
        return net, attach(net, cfg.run, **cfg.watch)
    observe = attach(model, cfg.run, **cfg.watch)
    return torch.compile(model, backend="aot_eager"), observe


def detach_watched(model: Any, net: Any, cfg: Any) -> None:
    """Stop watching what :func:`compiled_and_watched` watched: the compiled module in the order
    ``watch-compiled``, else ``model``."""
    detach(net if cfg.compile == "watch-compiled" else model, cfg.run)


def detach(model: Any, run: Path | None) -> None:
    """Stop watching ``model`` (when it was watched)."""
    if run is not None:
        gw.unwatch(model)


def train(script: Any, run: Path | None, **config: Any) -> Result:
    """Run a real-code script's ``train`` with its ``Config`` (``run=None``: unwatched)."""
    return script.train(script.Config(run=run, **config))


def trained(script: str, run: Path | None, config: dict[str, Any]) -> Result:
    """A run of the script named ``script`` (a module of this package) into ``run`` (None: unwatched), for
    the tests' pool (``tests/pool.py``): its losses, its run, and of its extras the lists of numbers (what
    pickles back)."""
    import importlib

    result = train(importlib.import_module(f"{__name__}.{script}"), run, **config)
    numbers = {k: v for k, v in result.extra.items() if isinstance(v, list) and all(isinstance(x, float) for x in v)}
    return Result(result.losses, run, numbers)


def aside(script: Any, run: Path | None, **config: Any) -> Any:
    """``train(script, run, **config)`` started in the tests' pool, beside the test process (which trains the
    other run of a comparison meanwhile): a future whose ``tests.pool.result()`` is its :func:`trained`."""
    from tests import pool

    return pool.submit(trained, script.__name__.rpartition(".")[2], run, config)


def unwatched_aside(script: Any, **config: Any) -> Any:
    """:func:`aside` unwatched: the plain run that a watched one is compared with."""
    return aside(script, None, **config)


# ------------------------------------------------- messages, up to the float noise of a training run
#: a number as messages print it (an integer, a decimal, a float in e-notation)
_NUMBER = r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
#: in a template: a number here (a figure a training run decides: a loss, a ratio)
ANY = "{n}"


def figures(message: str, template: str, *, anywhere: bool = False) -> list[float] | None:
    """The numbers ``message`` holds where ``template`` has :data:`ANY`, when it starts with (``anywhere``:
    holds) what the template says; None when it does not.

    A training run's figures differ between CPUs, thread counts and library versions, so a template holds
    none: every figure a run decides is :data:`ANY`, and the test asserts its magnitude on what this
    returns. The words and the integers (a step, a count, a layer's index) must be the same.
    """
    parts, at = [], 0
    for found in re.finditer(re.escape(ANY), template):
        parts += [re.escape(template[at:found.start()]), f"({_NUMBER})"]
        at = found.end()
    parts.append(re.escape(template[at:]))
    got = (re.search if anywhere else re.match)("".join(parts), message)
    return None if got is None else [float(g) for g in got.groups()]


# ------------------------------------------------- reading a run as a user reads it
def loud(result: Result) -> list[dict[str, Any]]:
    """The run's warnings and errors, in step order."""
    return [f for f in result.findings() if f["severity"] != "info"]


def summary(found: list[dict[str, Any]]) -> list[tuple[str, int, str | None, str]]:
    return [(f["kind"], f["step"], f["layer"], f["severity"]) for f in found]


def check(run: Path, *options: str) -> tuple[int, dict[str, Any]]:
    """``python -m gradwatch check RUN --format json``: its exit status and its parsed report."""
    done = subprocess.run([sys.executable, "-m", "gradwatch", "check", str(run), "--format", "json", *options],
                          capture_output=True, text=True, timeout=120)
    assert done.stderr == "", done.stderr
    return done.returncode, json.loads(done.stdout)
