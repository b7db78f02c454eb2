"""Origin (judge stage, rare path): where a NaN/Inf was born, why, and which samples — by replaying the step.

On every step the tracker only keeps references (no copies) to the root module's inputs, the
RNG state and the autocast state of each forward call, and the gradient that arrives at the
model's output (or, when that tensor is large, a device-side flag saying whether it was
finite). No hook, mode or copy is added to a healthy step.

When a step's single host read shows a non-finite loss or gradient, :meth:`Tracker.find`
replays the step, before the optimizer applies anything:

1. once with per-module finiteness hooks (:mod:`gradwatch.rootcause.locate`): the module;
2. once more with a dispatch mode inside that module (forward) or hooks on the autograd nodes
   it made (backward): the op, the source line and a fact about the op's inputs;
3. the module alone in a wider type: the cause (data, precision, not reproducible, model);

and names the samples whose rows went non-finite. For a loss spike or an exploding step,
:meth:`Tracker.explain` names the samples that carry most of the loss or gradient. Buffers
(BatchNorm statistics), RNG and autocast state and ``inplace`` flags are restored afterwards;
``.grad`` is never touched. What cannot be replayed (a forward that talks to other ranks, inputs
changed in place since the forward, a model that fails a second forward) falls back to the
cheap attribution (the latest layer with a non-finite gradient) with the reason stated.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from gradwatch.rootcause import pergrad, words
from gradwatch.rootcause.capture import (
    KEEP_GRAD_NUMEL,
    KEEP_GRADS,
    MAX_CAPTURES,
    SMALL_OUTPUT,
    Capture,
    checked_ids,
    sequence_first,
)
from gradwatch.rootcause.diagnose import diagnose, not_reproducible, poisoned, reference_norms
from gradwatch.rootcause.locate import Located, locate
from gradwatch.rootcause.samples import describe
from gradwatch.rootcause.state import Autocast, Rng, devices, finite, preserved, tensors
from gradwatch.step.layout import unwrap
from gradwatch.store.findings import Finding

__all__ = ["Capture", "Tracker", "finite", "tensors"]

log = logging.getLogger("gradwatch")

#: finding kinds whose samples are blamed by per-sample replays (loss spikes and exploding steps)
BLAMED = {"loss_spike": True, "exploding": False}  # kind -> whether observed per-sample losses are preferred
#: a kind's samples are blamed at most once per this many steps (a run that keeps exploding pays for
#: one per-sample replay per window, not one per step)
BLAME_COOLDOWN = 100


def _collective(model: nn.Module) -> bool:
    """Whether the model's forward pass talks to other ranks (a replay on one rank would hang)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())


def checked_samples(sample_ids: Any, sample_losses: Any) -> dict[str, Any]:
    """``observe``'s per-sample values, checked without reading them: ``{sample_ids, sample_losses}``
    (those given).

    Raises:
        TypeError: ids that are not a sequence or a 1-D tensor; losses that are not a tensor.
    """
    out: dict[str, Any] = {}
    if sample_ids is not None:
        out["sample_ids"] = checked_ids(sample_ids)
    if sample_losses is not None:
        if not isinstance(sample_losses, torch.Tensor):
            raise TypeError(f"observe(sample_losses=...) needs a tensor of one loss per sample, "
                            f"got {type(sample_losses).__name__}")
        out["sample_losses"] = sample_losses.detach().reshape(-1)
    return out


class Tracker:
    """Keeps what a replay of the current step needs, and replays it on demand."""

    def __init__(self, model: nn.Module) -> None:
        inner = unwrap(model)
        self._model = weakref.ref(inner)
        self.captures: list[Capture] = []
        #: the capture of the latest forward call (None when it was not captured, or none since :meth:`clear`)
        self.latest: Capture | None = None
        #: forward calls of the step came after the captured ones (counted up to the first: the root's
        #: hooks are out of the module during later calls)
        self.uncaptured = 0
        self.rng = Rng(inner)
        self.seq_first = sequence_first(inner)  # a (T, B, ...) input's samples run over its second dimension
        self._kinds = devices(inner)
        self._pending: dict[str, tuple[Any, bool]] = {}
        self._user_ids = False
        self._blamed: dict[str, int] = {}  # kind -> the step its samples were last blamed at
        #: every parameter's norm when watching began (names the weights that grew)
        self.reference = reference_norms(inner)

    # ------------------------------------------------------------- every step
    def capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Remember a forward call: references to its inputs, and the RNG and autocast state it starts from.

        The first ``MAX_CAPTURES`` forward calls of a step are kept; later ones cost nothing (a loop
        of many single-sample forward calls per step, such as a policy-gradient rollout, pays for
        sixteen of them).

        Returns:
            whether the call was captured.
        """
        if len(self.captures) >= MAX_CAPTURES:
            self.latest = None
            self._pending.clear()  # sample ids given ahead of this call were its own
            self.uncaptured += 1
            return False
        cap = Capture.of(args, kwargs, self.rng.get(), Autocast.now(self._kinds), self.seq_first)
        if self._pending:  # sample ids or losses given ahead of the call
            (cap.ids, cap.weak_ids), (cap.losses, _) = self._pending.pop("ids", (None, False)), \
                self._pending.pop("losses", (None, False))
        self.captures.append(cap)
        self.latest = cap
        return True

    def note(self, *, sample_ids: Any = None, sample_losses: Any = None, weak: bool = False) -> None:
        """The ids (or per-sample losses, checked by :func:`checked_samples`) of a batch's samples:
        for the latest forward call if it has none yet, else for the next one.

        ``weak`` ids (a DataLoader's indices, from ``watcher.batches``) give way to the user's own:
        once ``observe(sample_ids=...)`` is used they are ignored, and the latest call's are replaced.
        """
        if weak and self._user_ids:
            return
        if self.latest is None and len(self.captures) >= MAX_CAPTURES:
            return  # the latest forward call was not captured: its samples are not kept
        latest = self.latest
        if sample_ids is not None and not weak:
            self._user_ids = True
            if latest is not None and latest.weak_ids:
                latest.ids, latest.weak_ids = None, False
        for key, value in (("ids", sample_ids), ("losses", sample_losses)):
            if value is None:
                continue
            if latest is not None and getattr(latest, key) is None:
                setattr(latest, key, value)
                if key == "ids":
                    latest.weak_ids = weak
            else:
                self._pending[key] = (value, weak)

    def output(self, out: torch.Tensor, several: bool = False) -> Capture | None:
        """Remember (a reference to) the output of the latest forward call, when it is small enough
        (``several``: the call returned more than this tensor).

        Returns:
            that call's capture, where the gradient arriving at the output goes
            (:meth:`Capture.keep_grad`); None when the call was not captured, or when its output
            gradient is not kept (a small call after the step's first few: see ``KEEP_GRADS``).
        """
        cap = self.latest
        if cap is None:
            return None
        n, cap.several = out.numel(), several
        if n <= KEEP_GRAD_NUMEL:
            cap.output = out
        if len(self.captures) > KEEP_GRADS and n < SMALL_OUTPUT:
            cap.grad_kept = False
            return None
        return cap

    def clear(self) -> None:
        """Forget the step's forward calls."""
        self.captures = []
        self.latest = None
        self.uncaptured = 0

    # ------------------------------------------------------------ rare: replay
    def find(self, loss_finite: bool) -> dict[str, Any] | None:
        """Replay the step's forward calls until one reproduces a non-finite value, then explain it.

        Weights that already hold NaN/Inf (an earlier update applied non-finite gradients) are
        checked first, in one host read: then nothing is replayed, and the origin (``how``
        ``inspected``, ``source`` ``weights``) names them.

        Returns:
            the origin: ``phase``, ``layer``, ``type``, ``how`` (``replayed``, ``attributed`` or
            ``inspected``), ``root_cause`` (op, line, fact, cause), ``samples`` and ``replay_ms``;
            None when nothing was captured (the caller then attributes cheaply).
        """
        model = self._model()
        if model is None:
            return None
        weights = poisoned(model)  # an earlier update left NaN/Inf in the weights: nothing to replay
        if weights is not None:
            return weights
        if not self.captures:
            return None
        if _collective(model):  # replaying on this rank alone would wait forever for the others
            return {"how": "attributed", "note": "the step was not replayed: the model synchronises across ranks "
                                                 "in its forward pass (SyncBatchNorm)"}
        if any(cap.modified() for cap in self.captures):
            return {"how": "attributed", "note": "the step was not replayed: its input batch was changed in place "
                                                 "after the forward pass"}
        start = time.perf_counter()
        try:
            with warnings.catch_warnings(), preserved(model, self.rng):
                warnings.simplefilter("ignore")  # PyTorch's notes about backward hooks on input-less modules
                origin = self._find(model, loss_finite)
        except Exception as exc:  # a model that cannot be replayed: fall back, say why
            log.info("gradwatch: could not replay the step to find the NaN/Inf origin: %r", exc)
            said = (str(exc).strip().splitlines() or [""])[0][:300]  # not torch's list of every dispatch key
            origin = {"how": "attributed", "note": f"the step could not be replayed ({type(exc).__name__}: {said})"}
        origin["replay_ms"] = round((time.perf_counter() - start) * 1000, 1)
        return origin

    def _in_step(self, origin: dict[str, Any], k: int) -> dict[str, Any]:
        """Blamed samples of the step's ``k``-th forward call, counted over the step's calls in order
        (micro-batches), with ``call``: that call's place in the step (when it had several).
        """
        samples = origin.get("samples")
        if samples and len(self.captures) > 1:
            offset = sum(c.batch or 0 for c in self.captures[:k])
            samples.update(indices=[offset + i for i in samples["indices"]], call=k,
                           values=describe(self.captures[k], samples["indices"], offset),
                           batch=sum(c.batch or 0 for c in self.captures))
        return origin

    def _find(self, model: nn.Module, loss_finite: bool) -> dict[str, Any]:
        # a call whose replay stays finite while the loss is not says "the loss function": with several
        # calls in the step (a rollout, micro-batches) a later call may still reproduce it, so that verdict
        # waits until every captured call was replayed
        loss: tuple[int, Located] | None = None
        for k, cap in enumerate(self.captures):
            self.rng.set(cap.rng)
            located = locate(model, cap, loss_finite)
            if located is None:
                continue
            if located.source == "loss":
                loss = loss or (k, located)
                continue
            return self._in_step(diagnose(model, cap, located, self.rng, self.reference), k)
        if self.uncaptured:  # the NaN/Inf may have been born in a call that was not kept
            return {"how": "attributed", "root_cause": {"cause": None, "cause_detail": (
                f"the replays of the step's first {len(self.captures)} forward calls stayed finite; it had "
                f"more, which origin tracking does not keep (the first {MAX_CAPTURES} of a step are kept): the "
                "NaN/Inf was born in one of them, or in the loss function")},
                "note": "not reproduced by the kept forward calls: the layer is the latest with a NaN/Inf gradient"}
        # a call whose own output was non-finite when it ran: the model made it, not the loss function (a call
        # whose replay differs from its run, e.g. torch.func.functional_call with other weights, as MAML's inner
        # step: its replay stays finite)
        own = any(cap.output is not None and not finite(cap.output) for cap in self.captures)
        if loss is not None and not own:
            self.rng.set(self.captures[loss[0]].rng)
            return self._in_step(diagnose(model, self.captures[loss[0]], loss[1], self.rng, self.reference), loss[0])
        if not own and any(cap.several for cap in self.captures):  # a gradient through an output not kept
            return {"how": "attributed", "root_cause": {"cause": None, "cause_detail": (
                "the replay stayed finite, forward and backward from the model's first output; the model "
                "returns more than one tensor, and the NaN/Inf most likely came back through the gradient of "
                "another one: born in the loss computed from it (observe(loss=...) before optimizer.step() "
                "lets gradwatch tell)")},
                "note": "not reproduced from the model's first output: the layer is the latest with a NaN/Inf "
                        "gradient"}
        return not_reproducible(len(self.captures), "output" if own else "gradients")

    def explain(self, findings: list[Finding]) -> None:
        """Name the samples that carry a loss spike or an exploding step, on those findings
        (``data["samples"]``, ``data["replay_ms"]`` and a sentence of the message).
        """
        wanted = [f for f in findings if f.kind in BLAMED and f.severity != "info"
                  and f.step - self._blamed.get(f.kind, -BLAME_COOLDOWN) >= BLAME_COOLDOWN]
        model = self._model()
        if not wanted or model is None or not self.captures or any(cap.modified() for cap in self.captures):
            return
        done: dict[bool, tuple[dict[str, Any], float]] = {}
        for f in wanted:
            losses = BLAMED[f.kind] and any(cap.losses is not None for cap in self.captures)
            if losses not in done:
                done[losses] = self._blame(model, losses)
            samples, ms = done[losses]
            self._blamed[f.kind] = f.step
            f.data["samples"] = samples
            f.data["replay_ms"] = ms
            f.message = f"{f.message.rstrip()} {words.blame_sentence(samples)}"

    def _blame(self, model: nn.Module, losses: bool) -> tuple[dict[str, Any], float]:
        """The step's samples by per-sample losses or gradients, and the time it took (ms)."""
        start = time.perf_counter()
        try:
            with warnings.catch_warnings(), preserved(model, self.rng):
                warnings.simplefilter("ignore")
                samples = pergrad.blame(model, self.captures, self.rng, losses=losses)
        except Exception as exc:  # a model the per-sample replay cannot run: say so, leave the finding
            samples = {"indices": [], "ids": None, "how": None,
                       "reason": f"the per-sample replay failed ({type(exc).__name__}: {exc})"}
        return samples, round((time.perf_counter() - start) * 1000, 1)
