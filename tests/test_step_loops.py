"""Loops written the way people write them (issue 15 items 2, 3, 4): hand-written updates, GradScaler
under fp16 autocast, copies and saves of the watched model.
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradwatch as gw


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _manual_sgd(model: nn.Module, steps: int, *, nan_at: int | None = None, watched: bool = True,
                lr: float = 0.1) -> tuple[list[float], dict[int, torch.Tensor]]:
    """The classic loop that updates the parameters by hand: zero_grad, forward, backward, clip, p.data.add_."""
    gen = torch.Generator().manual_seed(0)
    losses, weights = [], {}
    for step in range(steps):
        x = torch.randn(16, 8, generator=gen)
        if step == nan_at:
            x[0, 0] = float("nan")
        model.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if watched:
            gw.watcher(model).observe(loss=loss)
        weights[step] = model[0].weight.detach().clone()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    return losses, weights


def test_a_loop_that_updates_by_hand_is_measured_and_never_called_a_gradscaler_overflow(tmp_path: Path) -> None:
    torch.manual_seed(0)
    bare, _ = _manual_sgd(_mlp(), 30, watched=False)
    torch.manual_seed(0)
    model = gw.watch(_mlp(), run=tmp_path / "run", console=False)
    losses, _ = _manual_sgd(model, 30)
    assert losses == bare  # watching changes nothing
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        assert run.steps == 30
        assert run.findings().empty, run.findings()[["step", "kind", "message"]]
        norms = run.metrics("grad_norm")
        measured = sorted(set(norms[norms["layer"].isna()]["step"]))
        assert measured == list(range(1, 30))  # every step after the first tells the loop's kind
        assert "end of backward" in run.meta["step_moment"]


def test_a_nan_in_a_loop_that_updates_by_hand_is_found_and_skipped(tmp_path: Path) -> None:
    model = gw.watch(_mlp(), run=tmp_path / "run", console=False)
    _, weights = _manual_sgd(model, 12, nan_at=5)
    assert torch.equal(weights[5], weights[6]), "the skip must leave the weights as they were"
    assert torch.isfinite(model[0].weight).all()
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        found = run.findings()
    assert list(zip(found["kind"], found["step"], found["action"])) == [("nonfinite", 5, "skip")]


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = (self.q(x) @ self.k(x).transpose(1, 2) / 4).masked_fill(~mask, float("-inf"))
        return F.softmax(scores, dim=-1) @ self.v(x)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.attn, self.head = nn.Linear(8, 16), _Attention(), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.emb(x), mask))


def _fp16_scaler_run(run: Path, *, observe: bool, masked_at: int = 7, huge_at: int = 4) -> None:
    """fp16 autocast + GradScaler: a fully masked attention row at ``masked_at``, a loss so large at
    ``huge_at`` that the scaled gradients overflow float16 (a real overflow the scaler skips).
    """
    torch.manual_seed(0)
    model = gw.watch(_Net(), run=run, console=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(12):
        x = torch.randn(4, 6, 8)
        mask = torch.tril(torch.ones(6, 6, dtype=torch.bool)).expand(4, 6, 6).clone()
        if step == masked_at:
            mask[1, 3, :] = False
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x, mask).float().pow(2).mean() * (1e6 if step == huge_at else 1.0)
        scaler.scale(loss).backward()
        if observe:
            gw.watcher(model).observe(loss=loss)
        scaler.step(opt)
        scaler.update()
    gw.unwatch(model)


@pytest.mark.slow
@pytest.mark.parametrize("observe", [True, False], ids=["loss-observed", "loss-not-observed"])
def test_under_a_gradscaler_a_nan_forward_is_nonfinite_with_its_origin_and_an_overflow_is_not(
        tmp_path: Path, observe: bool) -> None:
    run = tmp_path / "run"
    _fp16_scaler_run(run, observe=observe)
    with gw.open_run(run) as opened:
        found = opened.findings()
        scale = opened.metrics("amp_scale")
    found = found[found.kind.isin(["amp_overflow", "nonfinite"])].reset_index(drop=True)
    rows = list(zip(found["kind"], found["step"], found["layer"], found["severity"]))
    assert rows == [("amp_overflow", 4, None, "info"), ("nonfinite", 7, "attn", "error")], found
    assert found.iloc[1]["phase"] == "forward"
    assert "GradScaler" in found.iloc[0]["message"] and "loss scale now 128" in found.iloc[0]["message"]
    assert sorted(scale["step"]) == [4, 7] and scale[scale.step == 4]["value"].iloc[0] == 128.0
    check = subprocess.run([sys.executable, "-m", "gradwatch", "check", str(run), "--fail-on", "warning"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 1, check.stdout


def test_an_optimizer_loop_that_drops_gradients_claims_no_gradscaler(tmp_path: Path) -> None:
    model = gw.watch(_mlp(), run=tmp_path / "run", console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(12):
        opt.zero_grad()
        loss = model(torch.randn(8, 8)).pow(2).mean()
        loss.backward()
        if step % 4 == 3:
            continue  # the loop drops this batch's gradients (e.g. "skip a bad batch")
        opt.step()
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        assert run.findings().empty
        # 9 optimizer steps and the 2 dropped iterations a later backward told of; the last one's
        # gradients were still there when the run closed: not a step
        assert run.steps == 11
        assert list(run.records())[3].skipped


def _gan(tmp_path: Path, iterations: int, *, nan_at: int | None = None,
         losses: list[float] | None = None) -> tuple[gw.Run, gw.Run]:
    """The DCGAN loop: a discriminator step on real and detached fake samples, then a generator step
    whose loss goes back through the discriminator, whose gradients from it the next iteration zeroes."""
    torch.manual_seed(0)
    G = gw.watch(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)), run=tmp_path / "G", console=False)
    D = gw.watch(nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)), run=tmp_path / "D",
                 console=False)
    opt_d = torch.optim.Adam(D.parameters(), 2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(G.parameters(), 2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    for it in range(iterations):
        real = torch.randn(32, 2) + 3
        if it == nan_at:
            real[5, 0] = float("nan")
        D.zero_grad()
        fake = G(torch.randn(32, 4))
        loss_d = bce(D(real), torch.ones(32, 1)) + bce(D(fake.detach()), torch.zeros(32, 1))
        loss_d.backward()
        opt_d.step()
        G.zero_grad()
        bce(D(fake), torch.ones(32, 1)).backward()
        opt_g.step()
        if losses is not None:  # logged at the end of the iteration, as the DCGAN example does
            gw.watcher(D).observe(loss=loss_d)
            losses.append(loss_d.item())
    gw.unwatch(G)
    gw.unwatch(D)
    return gw.open_run(tmp_path / "G"), gw.open_run(tmp_path / "D")


def test_a_gan_discriminator_counts_its_own_steps_only(tmp_path: Path) -> None:
    """The generator's backward pass through the discriminator leaves it gradients that the next
    iteration zeroes: that belonged to the generator's step, not to a dropped step of the discriminator."""
    gen, disc = _gan(tmp_path, 25)
    for run in (gen, disc):
        assert run.steps == 25 and not run.step_info()["skipped"].any()
        assert run.findings().empty


def test_a_discriminator_loss_observed_after_the_generators_step_is_kept_for_the_next_step(
        tmp_path: Path) -> None:
    """The generator's forward call through the discriminator began a new iteration of it: the loss is
    for the step that follows (it was dropped with the generator's iteration)."""
    losses: list[float] = []
    _, disc = _gan(tmp_path, 12, losses=losses)
    recorded = disc.scalars(["loss"])["loss"]
    assert list(recorded.index) == list(range(1, 12))
    assert recorded.to_numpy() == pytest.approx(losses[:-1], rel=1e-6)


def test_a_nan_in_a_gan_discriminator_step_is_found_at_that_iteration(tmp_path: Path) -> None:
    _, disc = _gan(tmp_path, 20, nan_at=12)
    found = disc.findings()
    assert found[["step", "kind"]].values.tolist()[0] == [12, "nonfinite"]
    assert "input batch" in found.iloc[0]["message"]


# ------------------------------------------------------------------ gradients never cleared
def _loop(tmp_path: Path, *, clear: str, steps: int = 8, micro: int = 1, **options: object) -> gw.Run:
    """A plain loop clearing its gradients ``before`` backward, ``after`` the step, or ``never``."""
    torch.manual_seed(0)
    model = gw.watch(_mlp(), run=tmp_path / "run", console=False, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        if clear == "before":
            opt.zero_grad()
        for _ in range(micro):
            x = torch.randn(16, 8, generator=gen)
            (F.mse_loss(model(x), x[:, :1]) / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if clear == "after":
            opt.zero_grad(set_to_none=False)
    gw.unwatch(model)
    return gw.open_run(tmp_path / "run")


@pytest.mark.parametrize(("clear", "micro"), [("never", 1), ("before", 1), ("after", 1), ("after", 4)])
def test_gradients_never_cleared_between_steps_are_found_and_cleared_ones_are_not(
        tmp_path: Path, clear: str, micro: int) -> None:
    run = _loop(tmp_path, clear=clear, micro=micro)
    found = run.findings()
    if clear != "never":
        assert found.empty, list(found.message)
        assert "grad_stale_steps" not in run.scalars()
        return
    assert found[["step", "kind", "severity"]].values.tolist() == [[2, "stale_gradient", "warning"]]
    assert "no optimizer.zero_grad()" in found.iloc[0]["message"]
    assert run.scalars()["grad_stale_steps"].dropna().tolist() == [float(s) for s in range(1, 8)]


@pytest.mark.parametrize("clear", [True, False])
def test_a_gradient_penalty_taken_before_the_gradients_are_cleared_is_not_a_stale_step(
        tmp_path: Path, clear: bool) -> None:
    """WGAN-GP: the critic's gradient penalty (torch.autograd.grad with create_graph) comes before
    zero_grad(); that call adds nothing to .grad and is not the backward pass that tells."""
    torch.manual_seed(0)
    critic = gw.watch(nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)), run=tmp_path / "C",
                      console=False)
    opt = torch.optim.Adam(critic.parameters(), 1e-4, betas=(0.0, 0.9))
    for _ in range(8):
        real, fake = torch.randn(32, 2) + 3, torch.randn(32, 2)
        alpha = torch.rand(32, 1)
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        grads = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)[0]
        penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean()
        if clear:
            opt.zero_grad()
        (critic(fake).mean() - critic(real).mean() + 10 * penalty).backward()
        opt.step()
    gw.unwatch(critic)
    with gw.open_run(tmp_path / "C") as run:
        stale = run.findings().query("kind == 'stale_gradient'")
    assert stale["step"].tolist() == ([] if clear else [2])


@pytest.mark.parametrize("style", ["hand_set", "maml"])
def test_gradients_taken_with_autograd_grad_of_the_parameters_are_not_stale(tmp_path: Path, style: str) -> None:
    """``torch.autograd.grad(loss, params)`` writes no ``.grad``: a trainer that sets ``p.grad = g`` by hand
    (no zero_grad needed: it replaces them), or MAML's inner step taken before ``zero_grad(); backward()``,
    applies fresh gradients every step (they were called stale: torch refuses to say whether the engine
    runs a leaf's node under autograd.grad, and that refusal was read as "it adds to .grad")."""
    torch.manual_seed(0)
    model = gw.watch(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)), run=tmp_path / "run",
                     console=False)
    params = dict(model.named_parameters())
    opt = torch.optim.Adam(params.values(), 1e-3)
    for _ in range(8):
        x = torch.randn(8, 4)
        if style == "hand_set":
            loss = nn.functional.mse_loss(model(x), x[:, :1])
            for p, g in zip(params.values(), torch.autograd.grad(loss, list(params.values()))):
                p.grad = g
        else:
            inner = nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), x[:, :1])
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            fast = {n: w - 0.01 * g for (n, w), g in zip(params.items(), grads)}
            opt.zero_grad()
            nn.functional.mse_loss(torch.func.functional_call(model, fast, (x,)), x[:, :1]).backward()
        opt.step()
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        assert run.findings().empty, list(run.findings().message)
        assert "grad_stale_steps" not in run.scalars()


def test_gradwatchs_own_clip_does_not_pass_for_clearing_the_gradients(tmp_path: Path) -> None:
    """A clip action scales the gradients in place (a new version of the same tensor) before the
    optimizer applies them: what the next backward pass compares with is what was applied."""
    run = _loop(tmp_path, clear="never", rules=[gw.Rule(when="stale_gradient", do="clip", max_norm=1e-3)])
    assert run.findings()[["step", "kind", "action"]].values.tolist() == [[2, "stale_gradient", "clip"]]
    assert run.scalars()["grad_stale_steps"].dropna().tolist() == [float(s) for s in range(1, 8)]


# ------------------------------------------------------------------ copies
def _trained_watched(tmp_path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = gw.watch(_mlp(), run=tmp_path / "run", console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _train_once(model: nn.Module) -> None:
    model.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()


def _no_gradwatch_hooks(model: nn.Module) -> bool:
    hooks = [*model._forward_pre_hooks.values(), *model._forward_hooks.values()]
    hooks += [h for p in model.parameters() for h in (p._post_accumulate_grad_hooks or {}).values()]
    return not any("gradwatch" in getattr(h, "__module__", "") or "gradwatch" in repr(h) for h in hooks)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save", "AveragedModel"])
def test_a_watched_model_can_be_copied_and_saved_and_the_copy_is_not_watched(tmp_path: Path, how: str) -> None:
    model, opt = _trained_watched(tmp_path)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    elif how == "torch.save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    else:
        averaged = torch.optim.swa_utils.AveragedModel(model)
        averaged.update_parameters(model)
        twin = averaged.module
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    _train_once(twin)  # the copy runs; its inherited hooks do nothing and remove themselves
    assert _no_gradwatch_hooks(twin)
    with pytest.raises(gw.ConfigError, match="not watched"):
        gw.watcher(twin)
    before = gw.watcher(model).step
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    _train_once(model)
    assert gw.watcher(model).step == before + 1  # the original is still watched


# ---------------------------------------------------------------- pre-clip
def _clipping_loop(run: Path, *, max_norm: float, amp: bool, spike_at: int | None = 30,
                   steps: int = 40) -> list[float]:
    """A loop that clips its own gradients (after ``scaler.unscale_`` with a GradScaler), as
    widely copied trainers do; returns what ``clip_grad_norm_`` returned (the pre-clip norms).
    """
    torch.manual_seed(0)
    model = gw.watch(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)), run=run, console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    norms = []
    for step in range(steps):
        x, y = torch.randn(16, 8), torch.randn(16, 1) * (300.0 if step == spike_at else 1.0)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        gw.watcher(model).observe(loss=loss)
        scaler.step(opt)
        scaler.update()
    gw.unwatch(model)
    return norms


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "gradscaler"])
@pytest.mark.slow  # an explosion after a long baseline
def test_clip_grad_norm_does_not_hide_the_norm_before_it(tmp_path: Path, amp: bool) -> None:
    truth = _clipping_loop(tmp_path / "run", max_norm=1.0, amp=amp)
    with gw.open_run(tmp_path / "run") as run:
        pre = run.metrics("grad_norm_preclip")
        post = run.metrics("grad_norm")
        coef = run.metrics("clip_coef")
        found = run.findings()
    clipped = [s for s, n in enumerate(truth) if n > 1.0]
    assert sorted(pre["step"]) == clipped == sorted(coef["step"])  # recorded where the clip changed them
    for step, value in zip(pre["step"], pre["value"]):
        assert value == pytest.approx(truth[step], rel=1e-5)
    assert post[post.layer.isna() & (post.step == 30)]["value"].iloc[0] == pytest.approx(1.0, rel=1e-4)
    spikes = found[found.kind == "exploding"]
    assert 30 in set(spikes["step"]), found[["step", "kind", "message"]]
    assert "before clipping" in spikes[spikes.step == 30]["message"].iloc[0]


def test_a_clip_with_max_norm_zero_is_named_as_such(tmp_path: Path) -> None:
    _clipping_loop(tmp_path / "run", max_norm=0.0, amp=False, spike_at=None, steps=10)
    with gw.open_run(tmp_path / "run") as run:
        found = run.findings()
        coef = run.metrics("clip_coef")
    assert set(coef["value"]) == {0.0}
    assert list(found["kind"]) == ["zero_gradient"], found[["step", "kind", "message"]]
    assert "max_norm=0" in found["message"].iloc[0] and "scaled to zero" in found["message"].iloc[0]


def test_a_clip_by_value_at_zero_is_not_blamed_on_clip_grad_norm(tmp_path: Path) -> None:
    """``clip_grad_value_(params, 0)`` zeroes every gradient after backward: the loop never called
    ``clip_grad_norm_``, and the finding must not say it did."""
    torch.manual_seed(0)
    model = gw.watch(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), run=tmp_path / "run", console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(5):
        x = torch.randn(16, 4)
        loss = nn.functional.mse_loss(model(x), x[:, :1])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.0)
        opt.step()
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        found = run.findings()
    assert found[["step", "kind"]].values.tolist() == [[2, "zero_gradient"]]
    message = found["message"].iloc[0]
    assert "something between backward() and the step zeroes them, such as clip_grad_value_(..., 0)" in message
    assert not message.startswith("clip_grad_norm_") and "a clip_grad_norm_ with" not in message


def _validating_loop(run: Path, *, validate: bool, always_eval: bool = False) -> None:
    """A regression whose loop runs a validation pass in eval mode *without* torch.no_grad() before
    every tenth step (common), with a NaN in training sample 5 at step 20."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    gw.watch(model, run=run, console=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    xv = torch.randn(128, 16, generator=gen)
    if always_eval:
        model.eval()
    for step in range(30):
        x = torch.randn(32, 16, generator=gen)
        if step == 20:
            x[5, 3] = float("nan")
        if validate and step % 10 == 0:
            model.eval()
            F.mse_loss(model(xv), xv[:, :1])  # gradients on: a graph nobody backpropagates
            model.train()
        loss = F.mse_loss(model(x), x[:, :1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    gw.unwatch(model)


def test_a_validation_pass_in_eval_mode_with_gradients_on_is_part_of_no_step(tmp_path: Path) -> None:
    _validating_loop(tmp_path / "plain", validate=False)
    _validating_loop(tmp_path / "validated", validate=True)
    with gw.open_run(tmp_path / "plain") as plain, gw.open_run(tmp_path / "validated") as validated:
        error = validated.findings().iloc[0]
        assert (error.kind, error.step) == ("nonfinite", 20)
        assert error.data["samples"]["indices"] == [5] and error.data["samples"]["batch"] == 32
        assert "call" not in error.data["samples"], "the validation call is not one of the step's"
        # the activation statistics of a sampled step are the training batch's alone
        zero = {name: run.metrics("act_zero_frac", include_global=False).set_index(["step", "layer"])["value"]
                for name, run in (("plain", plain), ("validated", validated))}
        assert zero["validated"].loc[10].to_dict() == pytest.approx(zero["plain"].loc[10].to_dict())


def test_a_model_trained_in_eval_mode_throughout_is_still_replayed(tmp_path: Path) -> None:
    _validating_loop(tmp_path / "run", validate=False, always_eval=True)
    with gw.open_run(tmp_path / "run") as run:
        error = run.findings().iloc[0]
    assert (error.kind, error.step, error.data["root_cause"]["cause"]) == ("nonfinite", 20, "data")
    assert error.data["samples"]["indices"] == [5]
    assert error.data["hint"].startswith("look at the samples named"), "the data's hint, not an op's"


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_measures_each_leaf_once(tmp_path: Path, reentrant: bool) -> None:
    """``checkpoint(block, x, use_reentrant=False)`` runs the block's forward again inside backward: its
    leaves' statistics are the first run's, not the sum of both (act_norm was sqrt(2)x the true value)."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self, ckpt: bool) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
            self.head = nn.Linear(8, 2)
            self.ckpt = ckpt

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.ckpt:
                x = x.requires_grad_(True) if reentrant else x  # reentrant: an input that needs a gradient
                return self.head(checkpoint(self.block, x, use_reentrant=reentrant))
            return self.head(self.block(x))

    stats = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = gw.watch(Net(ckpt), run=tmp_path / str(ckpt), console=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(11):
            x = torch.randn(16, 8)
            loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
        gw.unwatch(model)
        with gw.open_run(tmp_path / str(ckpt)) as run:
            metrics = run.metrics()
            assert run.findings().empty
        sampled = metrics[metrics.metric.isin(["act_norm", "act_zero_frac"]) & (metrics.step == 10)]
        stats[ckpt] = sampled.set_index(["metric", "layer"])["value"].sort_index()
    assert list(stats[True].index) == list(stats[False].index) and len(stats[True]) >= 8
    assert np.allclose(stats[True].to_numpy(), stats[False].to_numpy(), rtol=1e-5)
