"""``gradwatch doctor``: pre-flight checks on real models, through the Python API and the command line."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gradwatch.doctor import CHECKS, CheckResult, diagnose, exit_code, load_target
from gradwatch.errors import ConfigError

TARGETS = Path(__file__).parent / "doctor_targets" / "targets.py"
ROOT = Path(__file__).parent.parent
ce = nn.functional.cross_entropy
NO_OVERFIT = ("overfit_batch",)

_spec = importlib.util.spec_from_file_location("doctor_targets", TARGETS)
assert _spec is not None and _spec.loader is not None
targets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(targets)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster and steadier


def by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return targets._batch()


def doctor(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m gradwatch doctor ARGS`` as a user runs it, outside a terminal."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COLUMNS": "200", "NO_COLOR": "1",
           "OMP_NUM_THREADS": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-m", "gradwatch", "doctor", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


# ------------------------------------------------------------------------------------------------ healthy
def test_healthy_mlp_passes_every_check_and_leaves_everything_as_it_was() -> None:
    model, data, loss_fn = targets.healthy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    results = diagnose(model, data, loss_fn)
    assert [r.name for r in results] == list(CHECKS)
    assert {r.name: r.status for r in results} == {name: "pass" for name in CHECKS}, [r.evidence for r in results]
    assert exit_code(results) == 0 and exit_code(results, "warning") == 0
    assert all(r.suggestion == "" for r in results)
    fit = by_name(results)["overfit_batch"]
    assert fit.data["losses"][-1] <= 0.1 * fit.data["losses"][0] and fit.data["steps"] <= 100
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the model's weights changed"
    assert all(p.grad is None for p in model.parameters()) and model.training
    assert torch.equal(states[0], torch.get_rng_state()), "torch's RNG state was not restored"
    assert random.getstate() == states[1] and np.array_equal(np.random.get_state()[1], states[2][1])


def test_results_are_deterministic_and_an_explicit_device_moves_copies_only() -> None:
    model, data, loss_fn = targets.healthy()
    runs = [diagnose(model, data, loss_fn, steps=20), diagnose(model, data, loss_fn, steps=20),
            diagnose(model, data, loss_fn, steps=20, device="cpu")]
    assert [r.to_json() for r in runs[0]] == [r.to_json() for r in runs[1]] == [r.to_json() for r in runs[2]]
    assert by_name(runs[0])["overfit_batch"].data["losses"] == by_name(runs[2])["overfit_batch"].data["losses"]


# ------------------------------------------------------------------------------------------ gradient path
def test_unused_submodule_fails_gradient_path_naming_it() -> None:
    results = diagnose(*targets.unused(), skip=NO_OVERFIT)
    path = by_name(results)["gradient_path"]
    assert path.status == "fail"
    assert "aux_head.weight" in path.evidence and "aux_head.bias" in path.evidence
    assert "unused or detached" in path.evidence and "nn.ModuleList" in path.suggestion
    assert path.data["unused"] == ["aux_head.weight", "aux_head.bias"]
    assert exit_code(results) == 1
    assert by_name(results)["gradient_flow"].status == "pass", "the used layers are healthy"


def test_detached_output_fails_with_no_grad_fn() -> None:
    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = targets.mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).detach()

    results = by_name(diagnose(Detached(), batch(), ce))
    path = results["gradient_path"]
    assert path.status == "fail"
    assert path.evidence.startswith("the loss does not depend on any trainable parameter (it has no grad_fn): "
                                    "6 of 6 trainable parameters got no gradient")
    assert results["overfit_batch"].status == "fail"


def test_frozen_parameters_warn_and_no_trainable_parameters_fail() -> None:
    model = targets.mlp()
    model[0].requires_grad_(False)
    path = by_name(diagnose(model, batch(), ce, skip=NO_OVERFIT))["gradient_path"]
    assert path.status == "warn" and "'0.weight', '0.bias'" in path.evidence and "frozen by mistake?" in path.evidence
    model.requires_grad_(False)
    results = by_name(diagnose(model, batch(), ce))
    assert results["gradient_path"].status == "fail" and "no trainable parameters" in results["gradient_path"].evidence
    assert results["overfit_batch"].status == "fail"


def test_layers_in_a_python_list_are_not_parameters() -> None:
    class Listed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [nn.Linear(16, 4)]  # not registered: the classic mistake

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[0](x)

    path = by_name(diagnose(Listed(), batch(), ce))["gradient_path"]
    assert path.status == "fail" and "nn.ModuleList" in path.suggestion


# ----------------------------------------------------------------------------------------------- mode
def test_model_in_eval_mode_warns() -> None:
    model = targets.mlp().eval()
    mode = by_name(diagnose(model, batch(), ce, skip=NO_OVERFIT))["train_mode"]
    assert mode.status == "warn" and "eval mode" in mode.evidence and "model.train()" in mode.suggestion
    assert not model.training, "the doctor does not change the mode"


def test_submodule_left_in_eval_mode_warns_naming_it() -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    model[2].eval()
    mode = by_name(diagnose(model, batch(), ce, skip=NO_OVERFIT))["train_mode"]
    assert mode.status == "warn" and "1 submodule is in eval mode: '2' (Dropout)" in mode.evidence
    assert mode.data["eval"] == ["2"]


# --------------------------------------------------------------------------------------- gradient flow
def deep_sigmoid(depth: int = 20) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(16, 32), nn.Sigmoid()]
    for _ in range(depth):
        layers += [nn.Linear(32, 32), nn.Sigmoid()]
    return nn.Sequential(*layers, nn.Linear(32, 4))


def test_deep_sigmoid_stack_vanishes_in_its_early_layers() -> None:
    flow = by_name(diagnose(deep_sigmoid(), batch(), ce, skip=NO_OVERFIT))["gradient_flow"]
    assert flow.status == "warn"
    vanishing = flow.data["vanishing"]
    assert vanishing[:3] == ["0", "2", "4"], vanishing
    assert len(vanishing) >= 12, "most of the stack, not only the layers far below the (tiny) median"
    assert "42" not in vanishing and flow.data["shrinking"], "the output layer is where the gradient is"
    assert not flow.data["exploding"]
    assert flow.evidence.startswith("vanishing:") and "of the first '0' (Linear)" in flow.evidence
    assert "residual" in flow.suggestion and "Kaiming" in flow.suggestion and "ReLU" in flow.suggestion
    norms = flow.data["norms"]
    assert norms["0"] < 1e-10 < norms["42"]


def test_shallow_sigmoid_stack_does_not_vanish() -> None:
    flow = by_name(diagnose(deep_sigmoid(depth=1), batch(), ce, skip=NO_OVERFIT))["gradient_flow"]
    assert flow.status == "pass", flow.evidence


def test_vanishing_threshold_is_an_option() -> None:
    # depth 3: the first layer's gradient is ~1e-3 of the median; a strict ratio catches it, the default does not
    model = deep_sigmoid(depth=3)
    assert by_name(diagnose(model, batch(), ce, skip=NO_OVERFIT))["gradient_flow"].status == "pass"
    flow = by_name(diagnose(model, batch(), ce, skip=NO_OVERFIT, vanishing_ratio=0.5))["gradient_flow"]
    assert flow.status == "warn" and flow.data["vanishing"][0] == "0"


def test_badly_scaled_initialisation_explodes() -> None:
    stack = [nn.Linear(32, 32) for _ in range(12)]
    for layer in stack:
        nn.init.normal_(layer.weight, std=3.0 / 32**0.5)  # gain 3 per layer, no normalisation
    model = nn.Sequential(nn.Linear(16, 32), *stack, nn.Linear(32, 4))
    flow = by_name(diagnose(model, batch(), ce, skip=NO_OVERFIT))["gradient_flow"]
    assert flow.status == "warn" and flow.data["exploding"] and flow.data["global_norm"] > 1e3
    assert "exploding: global gradient norm" in flow.evidence and "clip" in flow.suggestion


def test_nan_at_initialisation_fails_gradient_flow_and_names_the_module() -> None:
    class LogHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(self.proj(x))  # log of negatives

    model = nn.Sequential(nn.Linear(16, 16), LogHead())
    results = by_name(diagnose(model, batch(), ce))
    assert results["gradient_flow"].status == "fail" and "non-finite" in results["gradient_flow"].evidence
    acts = results["activations"]
    assert acts.status == "fail" and "from '1' (LogHead), whose inputs were finite" in acts.evidence
    assert results["overfit_batch"].status == "fail" and "before any update" in results["overfit_batch"].evidence


# ----------------------------------------------------------------------------------------- activations
def test_huge_negative_bias_before_relu_gives_dead_units() -> None:
    model = targets.mlp()
    with torch.no_grad():
        model[2].bias.fill_(-100.0)
    acts = by_name(diagnose(model, batch(), ce, skip=NO_OVERFIT))["activations"]
    assert acts.status == "warn"
    assert "in 1 layer: '3' (ReLU) 100% of 128" in acts.evidence and "'1' (ReLU)" not in acts.evidence
    assert acts.data["dead_fraction"]["3"] == 1.0 and acts.data["dead_fraction"]["1"] < 0.5
    assert "bias" in acts.suggestion and "LeakyReLU" in acts.suggestion


def test_a_functional_relu_killed_by_a_negative_bias_cuts_the_gradient_to_the_layers_before() -> None:
    """The ReLUs are ``F.relu`` (not modules: the activations check cannot see them): the layers before
    the dead one get a gradient of exactly 0, most of the model, so the median layer's is 0 too."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.fc3, self.out = (nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32),
                                                      nn.Linear(32, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            relu = nn.functional.relu
            return self.out(relu(self.fc3(relu(self.fc2(relu(self.fc1(x)))))))

    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.fc3.bias.fill_(-50.0)
    flow = by_name(diagnose(model, batch(), ce, skip=NO_OVERFIT))["gradient_flow"]
    assert flow.status == "warn"
    assert flow.data["zero"] == ["fc1", "fc2", "fc3"] and flow.data["vanishing"] == ["fc1", "fc2", "fc3"]
    assert flow.evidence.startswith("vanishing: 3 layers with a gradient of exactly 0 while others have one")
    assert "bias" in flow.suggestion and "LeakyReLU" in flow.suggestion


def test_oversized_weights_saturate_tanh() -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    with torch.no_grad():
        model[0].weight.mul_(50.0)
    acts = by_name(diagnose(model, batch(), ce, skip=NO_OVERFIT))["activations"]
    assert acts.status == "warn" and "saturated outputs" in acts.evidence and "'1' (Tanh)" in acts.evidence
    assert acts.data["saturated_fraction"]["1"] > 0.5 and "Xavier" in acts.suggestion


def test_nan_born_between_modules_names_its_parent() -> None:
    class Divides(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) / 0.0)

    acts = by_name(diagnose(Divides(), batch(), ce, skip=NO_OVERFIT))["activations"]
    assert acts.status == "fail"
    assert "from b (Linear), but its inputs were already non-finite" in acts.evidence
    assert "forward of (root) (Divides)" in acts.evidence


def test_non_finite_batch_fails_activations() -> None:
    x, y = batch()
    x[3, 2] = float("nan")
    acts = by_name(diagnose(targets.mlp(), (x, y), ce, skip=NO_OVERFIT))["activations"]
    assert acts.status == "fail" and "the batch itself" in acts.evidence


# ------------------------------------------------------------------------------------------- overfit
def test_zero_learning_rate_cannot_fit_one_batch() -> None:
    fit = by_name(diagnose(targets.mlp(), batch(), ce, lr=0.0))["overfit_batch"]
    assert fit.status == "fail" and "did not fall" in fit.evidence and "100 of 100" in fit.evidence
    assert fit.data["losses"][0] == fit.data["losses"][-1]


def test_frozen_zeroed_output_layer_cannot_fit_one_batch() -> None:
    model = targets.mlp()
    with torch.no_grad():
        model[4].weight.zero_()
        model[4].bias.zero_()
    model[4].requires_grad_(False)
    results = by_name(diagnose(model, batch(), ce))
    assert results["overfit_batch"].status == "fail"
    assert results["gradient_path"].status == "warn" and "'4.weight', '4.bias'" in results["gradient_path"].evidence
    assert results["gradient_flow"].status == "fail" and "no learning signal" in results["gradient_flow"].evidence
    assert exit_code(list(results.values())) == 1


def test_slow_fit_warns() -> None:
    fit = by_name(diagnose(targets.mlp(), batch(), ce, steps=3))["overfit_batch"]
    assert fit.status == "warn" and "after 3 of 3 Adam steps" in fit.evidence and "--steps" in fit.suggestion
    assert fit.data["losses"][-1] < fit.data["losses"][0]


def test_diverging_fit_names_the_step() -> None:
    class Exp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor(1.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.exp(10 * self.w**2) * x[:, :4]  # Adam's first step moves w by ~lr: exp(810) overflows

    fit = by_name(diagnose(Exp(), batch(), ce, lr=10.0, steps=20))["overfit_batch"]
    assert fit.status == "fail" and "the loss became nan at step 1" in fit.evidence
    assert "lower the learning rate" in fit.suggestion


def test_a_loss_that_is_not_finite_before_any_update_does_not_blame_the_learning_rate() -> None:
    class Overflowing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor(100.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.exp(self.w) * x[:, :4]  # exp(100) overflows float32 at initialisation

    fit = by_name(diagnose(Overflowing(), batch(), ce))["overfit_batch"]
    assert fit.status == "fail" and fit.evidence == "the loss is nan before any update"  # cross-entropy of inf logits
    assert "learning rate" not in fit.suggestion and "exp of large values" in fit.suggestion


# --------------------------------------------------------------------------------- autograd functions
class SwishGood(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s))


class SwishWrong(SwishGood):
    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(x)  # forgets the product rule


class ScaledLinear(torch.autograd.Function):
    """New-style (setup_context) Function with a parameter input and a non-tensor argument."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
        return scale * x @ weight.t()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, weight, scale = inputs
        ctx.save_for_backward(x, weight)
        ctx.scale = scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        return ctx.scale * grad @ weight, ctx.scale * grad.t() @ x, None


class ScaledLinearWrongWeightGrad(ScaledLinear):
    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        return ctx.scale * grad @ weight, grad.t() @ x, None  # forgets the scale in the weight gradient


swish_wrong = SwishWrong.apply  # the common alias, bound before the doctor runs


class Net(nn.Module):
    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor], linear: type[ScaledLinear] = ScaledLinear):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.act = act
        self.linear = linear
        self.out = nn.Parameter(torch.randn(4, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear.apply(self.act(self.inp(x)), self.out, 2.0)


def test_correct_custom_functions_pass_gradcheck() -> None:
    check = by_name(diagnose(Net(SwishGood.apply), batch(), ce, skip=NO_OVERFIT))["autograd_functions"]
    assert check.status == "pass" and "gradcheck passed for SwishGood, ScaledLinear" in check.evidence
    assert check.data["functions"]["ScaledLinear"]["status"] == "pass"


@pytest.mark.parametrize("act", [SwishWrong.apply, swish_wrong], ids=["apply", "alias"])
def test_wrong_backward_fails_naming_the_class(act: Callable[[torch.Tensor], torch.Tensor]) -> None:
    check = by_name(diagnose(Net(act), batch(), ce, skip=NO_OVERFIT))["autograd_functions"]
    assert check.status == "fail"
    assert "gradcheck failed for SwishWrong: Jacobian mismatch for output 0 with respect to input 0" in check.evidence
    assert "ScaledLinear" in check.evidence and check.data["functions"]["ScaledLinear"]["status"] == "pass"
    assert "forward" not in SwishWrong.__dict__, "the recorder restored the classes"
    assert SwishGood.__dict__["forward"].__func__.__qualname__ == "SwishGood.forward"


def test_wrong_weight_gradient_on_thousands_of_elements_is_caught() -> None:
    """Fast-mode gradcheck's tolerance grows with the input size; the doctor's must not."""
    model = Net(SwishGood.apply, ScaledLinearWrongWeightGrad)
    check = by_name(diagnose(model, batch(), ce, skip=NO_OVERFIT))["autograd_functions"]
    assert check.status == "fail"
    assert "ScaledLinearWrongWeightGrad: Jacobian mismatch for output 0 with respect to input 1" in check.evidence
    assert check.data["seconds"] < 10, "a failing fast gradcheck must not recompute full Jacobians"


def test_no_custom_function_passes() -> None:
    check = by_name(diagnose(targets.mlp(), batch(), ce, skip=NO_OVERFIT))["autograd_functions"]
    assert check.status == "pass" and check.evidence == "no custom autograd.Function reached"


# -------------------------------------------------------------------------------------- the contract
class HFStyle(nn.Module):
    """Takes keyword inputs and returns an object carrying ``.loss``, like a Hugging Face model."""

    def __init__(self) -> None:
        super().__init__()
        self.net = targets.mlp()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        logits = self.net(input_ids)
        return types.SimpleNamespace(loss=ce(logits, labels), logits=logits)


def test_dict_batch_without_loss_fn_uses_the_output_loss() -> None:
    x, y = batch()
    results = diagnose(HFStyle(), {"input_ids": x, "labels": y}, None, steps=30)
    assert all(r.status in ("pass", "warn") for r in results), [r.evidence for r in results]
    assert by_name(results)["gradient_path"].status == "pass"


def test_tuple_inputs_are_spread() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 4), nn.Linear(16, 4)

        def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
            return self.a(x1) + self.b(x2)

    x, y = batch()
    results = diagnose(Two(), ((x, x.flip(0)), y), ce, skip=NO_OVERFIT)
    assert by_name(results)["gradient_path"].status == "pass"


class TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), x


def test_contract_violations_are_config_errors() -> None:
    model = targets.mlp()
    with pytest.raises(ConfigError, match=r"shape \(32,\) as the loss; it must be a floating-point scalar"):
        diagnose(model, batch(), lambda out, y: ce(out, y, reduction="none"))
    with pytest.raises(ConfigError, match=r"the loss is the model's output, which gave a torch.float32 tensor of "
                                          r"shape \(32, 4\)"):
        diagnose(model, batch()[0], None)
    with pytest.raises(ConfigError, match="without a loss_fn the model must return the loss .* it returned a tuple"):
        diagnose(TupleOut(), batch()[0], None)
    with pytest.raises(ConfigError, match=r"batch\[1\]\['mask'\] is a str"):
        diagnose(model, (batch()[0], {"mask": "no"}), ce)
    with pytest.raises(ConfigError, match="must be a pair"):
        diagnose(model, (*batch(), batch()[0]), ce)
    with pytest.raises(ConfigError, match="must be a torch.nn.Module"):
        diagnose("model", batch(), ce)  # type: ignore[arg-type]


def test_invalid_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown doctor option 'step'; valid options: steps"):
        diagnose(targets.mlp(), batch(), ce, step=3)
    with pytest.raises(ConfigError, match="steps must be an integer >= 1"):
        diagnose(targets.mlp(), batch(), ce, steps=0)
    with pytest.raises(ConfigError, match="dead_fraction must be a number between 0 and 1"):
        diagnose(targets.mlp(), batch(), ce, dead_fraction=1.5)
    with pytest.raises(ConfigError, match="skip must be a list of checks"):
        diagnose(targets.mlp(), batch(), ce, skip=["gradient"])
    with pytest.raises(ConfigError, match="device 'nope' cannot be used"):
        diagnose(targets.mlp(), batch(), ce, device="nope")
    with pytest.raises(ConfigError, match="fail_on must be one of warning, error"):
        exit_code([], "info")


def test_a_crashing_forward_fails_its_checks_and_the_others_still_run() -> None:
    model = nn.Sequential(nn.Linear(8, 4))  # the batch has 16 features
    results = by_name(diagnose(model, batch(), ce))
    assert results["train_mode"].status == "pass"
    for name in ("gradient_path", "gradient_flow", "activations", "overfit_batch", "autograd_functions"):
        assert results[name].status == "fail", name
        assert "the check raised RuntimeError: mat1 and mat2 shapes cannot be multiplied" in results[name].evidence
        assert "\n" not in results[name].evidence


def test_skip_leaves_checks_out() -> None:
    results = diagnose(targets.mlp(), batch(), ce, skip=["overfit_batch", "autograd_functions"])
    assert [r.name for r in results] == ["gradient_path", "train_mode", "gradient_flow", "activations"]


def test_fail_on_warning_counts_warnings() -> None:
    results = diagnose(targets.mlp().eval(), batch(), ce, skip=NO_OVERFIT)
    assert exit_code(results, "error") == 0 and exit_code(results, "warning") == 1


# ------------------------------------------------------------------------------------- loading targets
def test_load_target_from_a_script_and_from_a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, data, loss_fn = load_target(f"{TARGETS}:healthy")
    assert isinstance(model, nn.Sequential) and loss_fn is ce and len(data) == 2
    assert str(TARGETS.parent) not in sys.path, "the script's folder is on sys.path only while loading"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "factories.py").write_text(
        "import torch\nclass Make:\n    @staticmethod\n    def build():\n"
        "        return torch.nn.Linear(3, 1), torch.ones(2, 3), lambda out: out.pow(2).mean()\n")
    monkeypatch.chdir(tmp_path)  # a module is looked up in the current directory, as python -m does
    model, data, loss_fn = load_target("pkg.factories:Make.build")
    assert isinstance(model, nn.Linear) and loss_fn is not None
    assert by_name(diagnose(model, data, loss_fn, skip=NO_OVERFIT))["gradient_path"].status == "pass"


@pytest.mark.parametrize(("target", "message"), [
    ("no_colon", "target 'no_colon' must be path/to/script.py:factory or package.module:factory"),
    ("missing.py:make", "no such file: 'missing.py'"),
    ("tests:make", "'tests' has no attribute 'make'"),
    ("no_such_package.models:make", "no module named 'no_such_package'"),
    (f"{TARGETS}:NOT_CALLABLE", "NOT_CALLABLE is an int, not a callable factory"),
    (f"{TARGETS}:not_a_model", "the model is a str; it must be a torch.nn.Module"),
    (f"{TARGETS}:bad_batch", "batch[1] is a str"),
    (f"{TARGETS}:raises", "raised RuntimeError: checkpoint weights.pt not found"),
])
def test_bad_targets_raise_one_line_config_errors(target: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_target(target)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_script_that_fails_at_import(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import torch\nraise SystemExit('usage: broken.py --data DIR')\n")
    with pytest.raises(ConfigError, match=r"importing '.*broken.py' raised SystemExit: usage: broken.py --data DIR"):
        load_target(f"{script}:make")
    assert not any(name.startswith("gradwatch_doctor_target_broken") for name in sys.modules)


# ------------------------------------------------------------------------------------------ command line
@pytest.mark.slow  # the doctor in a subprocess
def test_cli_healthy_script_exits_0_with_a_table() -> None:
    result = doctor(f"{TARGETS.relative_to(ROOT)}:healthy")
    assert result.returncode == 0, result.stderr
    for name in CHECKS:
        assert name in result.stdout
    assert "PASS: 6 pass, 0 warn, 0 fail" in result.stdout and "\x1b[" not in result.stdout


@pytest.mark.slow  # the doctor in subprocesses
def test_cli_unused_submodule_exits_1_and_json_parses() -> None:
    result = doctor(f"{TARGETS}:unused", "--format", "json", "--skip", "overfit_batch")
    assert result.returncode == 1, result.stderr
    rows = json.loads(result.stdout)
    assert [set(row) for row in rows] == [{"check", "status", "evidence", "suggestion"}] * 5
    status = {row["check"]: row["status"] for row in rows}
    assert status["gradient_path"] == "fail" and "aux_head.weight" in rows[0]["evidence"]
    assert set(status.values()) == {"pass", "fail"}


@pytest.mark.parametrize(("suffix", "message"), [
    ("missing.py:make", "gradwatch: error: no such file: 'missing.py'"),
    (f"{TARGETS}:junk", "returned a tuple of 2 items; it must return (model, batch, loss_fn)"),
    (f"{TARGETS}:unreduced", "gradwatch: error: loss_fn gave a torch.float32 tensor of shape (32,)"),
])
@pytest.mark.slow  # the doctor in a subprocess per target
def test_cli_bad_target_exits_2_with_one_line(suffix: str, message: str) -> None:
    result = doctor(suffix)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr


@pytest.mark.slow  # the doctor in subprocesses
def test_cli_module_path_form_and_fail_on_warning(tmp_path: Path) -> None:
    (tmp_path / "frozen_models.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))\n"
        "    model[0].bias.requires_grad_(False)  # frozen: a warning\n"
        "    return model, (torch.randn(32, 16), torch.randint(0, 4, (32,))), nn.functional.cross_entropy\n")
    result = doctor("frozen_models:make", "--format", "json", "--fail-on", "warning", pythonpath=tmp_path)
    assert result.returncode == 1, result.stderr + result.stdout
    status = {row["check"]: row["status"] for row in json.loads(result.stdout)}
    assert status == {**{name: "pass" for name in CHECKS}, "gradient_path": "warn"}, "a warning, and only one"
