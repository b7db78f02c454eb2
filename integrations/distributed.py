"""torch.distributed: every rank watches its replica, the ranks agree on every finding, rank 0 writes.

``gw.watch(DistributedDataParallel(model), run=...)`` works unchanged in every rank of a process
group; gradwatch notices the initialised group and:

- **measures on every rank** (each rank's gradients, activations and loss);
- **agrees on findings**: at each step, before any action, the ranks sum how many findings each
  has (one tiny all-reduce on the host); only when some rank has one do they exchange them
  (``all_gather_object``), so every rank judges the same union of findings — a NaN born on one
  rank's batch gives the same action (skip, rollback, halt ...) on every rank in the same step,
  and no rank is left waiting in a collective;
- **writes from rank 0 only**: the run directory, store, TensorBoard files, verdict and console
  lines come from rank 0 (its statistics; with DDP the gradients are the same on every rank after
  the all-reduce). A finding made on other ranks says which (``data["ranks"]``);
- **acts together**: a rollback restores the newest snapshot that every rank holds, intact; where
  some rank holds none (its ``snapshot_dir`` full or unwritable), every rank skips the step instead,
  and where none is intact on every rank, every rank halts; the finding's outcome names the ranks
  that lacked one (``ranks_without_snapshot``);
- **checks the replicas** every ``replica_check_every`` steps, and at the step after a rollback:
  each parameter's norm and sum are compared across ranks; a mismatch beyond ``replica_tolerance`` (relative) is a
  ``replica_divergence`` error naming the first layer that differs (replicas that drifted apart:
  a missed all-reduce, a rank-dependent update, non-deterministic kernels).

Control messages travel on a gloo group (created beside an NCCL default group), so agreeing
costs no device synchronisation.

FSDP2 (``torch.distributed.fsdp.fully_shard``, parameters and gradients as ``DTensor`` shards):
each rank measures its own shards, and the per-parameter gradient norms, largest gradient values,
parameter norms and update norms are combined across ranks (root of the summed squares, maximum)
before anything is judged, so per-layer numbers are the whole model's. Activation statistics stay
each rank's own. The replica check does not apply (the ranks hold different shards).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gradwatch.store.findings import Finding


def active() -> bool:
    """Whether this process is one of several in an initialised process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def moment_missed(group: Group, steps: Any, moment: int, kind: str, args: tuple[Any, ...]) -> bool:
    """Whether gradwatch failed on this rank in a step's moment (call number ``moment`` of a hook of
    ``kind``) before that step's collectives began: the other ranks wait in them for this one.
    """
    if group.in_step or group.begun_at == moment or kind not in ("step_pre", "gradients_ready", "closure"):
        return False
    if kind == "closure":  # a closure is measured only for the model's own optimizers
        return True
    opt = args[0] if args else None
    if (kind == "step_pre" and steps.signalled) or steps.closed or steps.optimizers.entry(opt) is None:
        return False
    return steps.open is None or id(opt) in steps.open.optimizers  # not joining a step already open


def _key(finding: Finding) -> tuple[Any, ...]:
    """Findings with one key are one finding seen on several ranks.

    A NaN born on one rank reaches every rank through the gradient all-reduce, where it is
    attributed to some other layer: one non-finite finding per severity and step.
    """
    if finding.kind == "nonfinite":
        return (finding.kind, finding.severity)
    return (finding.kind, finding.layer, finding.severity, finding.phase)


def _born_here(finding: Finding) -> bool:
    """The NaN/Inf was born on the rank that made this finding: its replay found the origin, or its own
    output was NaN/Inf in a step whose replay stayed finite (a fault of this rank's, not reproducible).
    """
    root = finding.data.get("root_cause")
    return finding.data.get("origin") == "replayed" or (isinstance(root, dict) and root.get("seen_in") == "output")


class Group:
    """The ranks training one model together, as gradwatch sees them (create it on every rank)."""

    def __init__(self, check_every: int = 100, tolerance: float = 1e-5) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.check_every = check_every
        self.tolerance = tolerance
        # findings and checksums are host data: keep them off an NCCL group (no device sync)
        self._pg = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        #: gradwatch failed on this rank: the next :meth:`share` tells every rank, and all leave together
        self.leaving = False
        #: the ranks that left at the last :meth:`share` (every rank then stops watching)
        self.departed: list[int] = []
        self._share_pending = False
        self._replicas_pending = False
        self._params = 0
        self.begun_at = 0
        #: compare the replicas at the next step whatever ``check_every`` says (after a rollback)
        self.check_next = False

    def begin(self, step: int, params: Sequence[torch.Tensor], moment: int = 0) -> None:
        """A step's collectives begin (on every rank alike): replica check when due, then :meth:`share`
        (``moment``: which call of a step's moment began them, see :func:`moment_missed`).
        """
        from gradwatch.step.measure import sharded

        self.begun_at = moment
        self._params = len(params)
        self._share_pending = True
        self._replicas_pending = self.due(step) and bool(params) and not sharded(list(params))

    @property
    def in_step(self) -> bool:
        """Whether this rank began a step whose :meth:`share` the other ranks still wait for."""
        return self._share_pending

    def leave(self) -> None:
        """Leave in the middle of a step, after gradwatch failed on this rank: take part in the remaining
        collectives of the step with nothing of its own, saying that it leaves, so no rank waits for it.
        """
        self.leaving = True
        if self._replicas_pending:
            self._replicas_pending = False
            mine = torch.zeros(2 * self._params, dtype=torch.float64)
            self._dist.all_gather([torch.empty_like(mine) for _ in range(self.size)], mine, group=self._pg)
        if self._share_pending:
            self.share([])

    @property
    def writes(self) -> bool:
        """Whether this rank writes the run (rank 0)."""
        return self.rank == 0

    def share(self, findings: Sequence[Finding]) -> list[Finding]:
        """Every rank's findings of this step, the same list on every rank (call it on all ranks).

        A finding of the same kind, layer, severity and phase on several ranks is kept once, with
        the ranks that made it in ``data["ranks"]``; a non-finite finding is kept once per step,
        from the rank where the NaN/Inf was born (its origin was found by replay) when there is one.
        """
        self._share_pending = False
        # one all-reduce: how many findings in all, and which ranks leave (gradwatch failed there)
        status = torch.zeros(1 + self.size, dtype=torch.int64)
        status[0] = len(findings)
        status[1 + self.rank] = int(self.leaving)
        self._dist.all_reduce(status, group=self._pg)
        self.departed = [r for r in range(self.size) if int(status[1 + r])]
        if int(status[0]) == 0:
            return []
        gathered: list[Any] = [None] * self.size
        self._dist.all_gather_object(gathered, [dataclasses.asdict(f) for f in findings], group=self._pg)
        merged: dict[tuple[Any, ...], Finding] = {}
        for rank, items in enumerate(gathered):
            for item in items or []:
                finding = Finding(**item)
                key = _key(finding)
                kept = merged.get(key)
                if kept is None:
                    finding.data = {**finding.data, "ranks": [rank]}
                    merged[key] = finding
                elif finding.kind == "nonfinite" and _born_here(finding) and not _born_here(kept):
                    # the rank where the NaN was born names its origin; the others only saw it arrive
                    finding.data = {**finding.data, "ranks": [*kept.data["ranks"], rank], "born_on_rank": rank}
                    merged[key] = finding
                else:
                    kept.data["ranks"].append(rank)
        out = list(merged.values())
        for finding in out:
            ranks = finding.data["ranks"]
            if "born_on_rank" in finding.data:
                finding.message = f"{finding.message} (born on rank {finding.data['born_on_rank']} of {self.size})"
            elif len(ranks) < self.size:
                which = ", ".join(map(str, ranks))
                finding.message = f"{finding.message} (on rank{'s' if len(ranks) > 1 else ''} {which} of {self.size})"
        return out

    def combine(self, host: np.ndarray, spans: Sequence[tuple[int, int, str]]) -> np.ndarray:
        """Combine per-shard statistics across ranks (FSDP), in place: the whole model's numbers on every rank.

        ``spans`` are ``(start, stop, how)`` ranges of ``host``: ``"norm"`` ranges hold norms of each
        rank's shards (combined as the root of the sum of squares), ``"max"`` ranges largest values.
        Two all-reduces of host values, on the gloo group.
        """
        norm = [(a, b) for a, b, how in spans if how == "norm" and b > a]
        top = [(a, b) for a, b, how in spans if how == "max" and b > a]
        if norm:
            squares = torch.from_numpy(np.concatenate([host[a:b] for a, b in norm]) ** 2)
            self._dist.all_reduce(squares, group=self._pg)
            k = 0
            for a, b in norm:
                host[a:b] = np.sqrt(squares[k:k + b - a].numpy())
                k += b - a
        if top:
            values = np.concatenate([host[a:b] for a, b in top])
            largest = torch.from_numpy(np.where(np.isnan(values), np.inf, values))  # a NaN shard: unbounded
            self._dist.all_reduce(largest, op=self._dist.ReduceOp.MAX, group=self._pg)
            k = 0
            for a, b in top:
                host[a:b] = largest[k:k + b - a].numpy()
                k += b - a
        return host

    def due(self, step: int) -> bool:
        """Whether the replicas are compared at this step."""
        return self.check_every > 0 and (self.check_next or step % self.check_every == 0)

    def common_steps(self, mine: Sequence[int]) -> tuple[list[int], list[int]]:
        """The snapshot steps every rank holds (newest first), and the ranks that hold none of the newest
        any rank holds (call it on all ranks; one ``all_gather_object`` of a few integers).
        """
        gathered: list[Any] = [None] * self.size
        self._dist.all_gather_object(gathered, sorted(mine), group=self._pg)
        held = [set(steps or ()) for steps in gathered]
        common = sorted(set.intersection(*held), reverse=True)
        newest = max((max(h) for h in held if h), default=None)
        lacking = [rank for rank, h in enumerate(held) if newest is not None and newest not in h]
        return common, lacking

    def everywhere(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (call it on all ranks; one tiny all-reduce)."""
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        self._dist.all_reduce(flag, op=self._dist.ReduceOp.MIN, group=self._pg)
        return bool(flag[0])

    @torch.no_grad()
    def check_replicas(self, step: int, params: Sequence[torch.Tensor], owners: Sequence[str | None]) -> list[Finding]:
        """Compare every parameter's norm and sum across ranks (call it on all ranks at the same step).

        Args:
            step: the step being judged.
            params: the model's parameters, in the same order on every rank.
            owners: the layer each parameter belongs to (for the message), None when unknown.
        """
        from gradwatch.step.measure import sharded

        self._replicas_pending = self.check_next = False
        if not params or sharded(list(params)):  # FSDP: each rank holds other shards, nothing to compare
            return []
        detached = [p.detach() for p in params]
        norms = torch.stack(torch._foreach_norm(detached)).double()
        sums = torch.stack([p.sum() for p in detached]).double()
        mine = torch.cat([norms, sums]).cpu()  # the one host read of this check
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        self._dist.all_gather(gathered, mine, group=self._pg)
        table = torch.stack(gathered)  # ranks x (norms, sums)
        spread = (table.max(dim=0).values - table.min(dim=0).values).abs()
        scale = table.abs().max(dim=0).values.clamp_min(1e-12)
        relative = (spread / scale).numpy()
        bad = [i for i, r in enumerate(relative) if not math.isfinite(r) or r > self.tolerance]
        if not bad:
            return []
        n = len(params)
        first = bad[0] % n
        params_bad = sorted({i % n for i in bad})
        layer = owners[first]
        worst = max((float(relative[i]) for i in bad if math.isfinite(relative[i])), default=math.inf)
        message = (f"the model replicas differ across the {self.size} ranks at step {step}: "
                   f"{len(params_bad)} parameter(s) disagree, first in {layer or 'the model'} "
                   f"(relative difference {worst:.3g} > {self.tolerance:g})")
        return [Finding("replica_divergence", "error", step, layer, message, value=worst,
                        data={"parameters": len(params_bad), "tolerance": self.tolerance,
                              "hint": "make every rank apply the same update: wrap the model in "
                                      "DistributedDataParallel, seed every rank alike, and avoid "
                                      "rank-dependent code between backward and optimizer.step()"})]
