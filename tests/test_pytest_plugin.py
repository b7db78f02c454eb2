"""The gradwatch pytest plugin: fixture, marker, options, and what a failing test reports.

Inner test sessions run in-process (``pytester.runpytest_inprocess``): a subprocess would pay
torch's import (seconds on two cores) for every session, and in-process lets every session be
followed by a check that it left nothing behind in this process — no global module hook of
torch, no live watcher. The plugin keeps no module-level state (its settings live in the
session's config stash), so sessions cannot leak into each other through it. pytester restores
``sys.modules`` after each session, dropping what the session imported; torch's lazily imported
modules (``torch._dynamo``, imported by the first ``optimizer.step()``) register C++ operator
libraries that cannot be registered twice, so ``_warm`` imports them in this process once, before
the first session. Only the import-cost check needs a fresh interpreter.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.nn.modules import module as torch_module

import gradwatch as gw
from gradwatch import pytest_plugin as plugin
from gradwatch.judging import gate
from gradwatch.watching import registry

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

#: the model and training loop the inner test files share
TRAINLIB = '''
import torch
from torch import nn


class LogFeatures(nn.Module):
    """log(x): NaN for a negative input."""

    def forward(self, x):
        return torch.log(x)


class Net(nn.Module):
    def __init__(self, kind="healthy"):
        super().__init__()
        self.features = LogFeatures() if "nan" in kind else nn.Identity()
        self.fc1 = nn.Linear(4, 16)
        self.act = nn.ReLU() if "dead" in kind else nn.Tanh()
        self.fc2 = nn.Linear(16, 1)
        if "dead" in kind:  # every ReLU unit starts dead
            with torch.no_grad():
                self.fc1.bias.fill_(-10.0)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.features(x))))


def make(kind="healthy"):
    torch.manual_seed(0)
    return Net(kind)


def train(model, steps=12, poison_step=None):
    """SGD regression on positive inputs; at poison_step one input is negative."""
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.randn(4, 1)
    losses = []
    for step in range(steps):
        x = torch.rand(32, 4) + 0.1
        if step == poison_step:
            x[0, 0] = -1.0
        loss = nn.functional.mse_loss(model(x), x @ target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
'''


def _global_hooks() -> list[int]:
    return [len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks),
            len(torch_module._global_forward_hooks_always_called)]


@pytest.fixture(scope="module")
def _warm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Train, trip and judge one watched model here, so that inner sessions import nothing of torch's.

    Also one intra-op thread while this module runs: the models are tiny, and on a busy two-core
    machine spinning OpenMP threads only slow every session down.
    """
    import torch
    from torch import nn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    run = tmp_path_factory.mktemp("warm") / "run"
    model = gw.watch(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 1)), run=run, console=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(2):
        x = torch.full((4, 2), float("nan")) if step else torch.ones(4, 2)
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    gw.unwatch(model)
    assert [item.kind for item in gate.items(gw.open_run(run).findings())] == ["nonfinite"]
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def run_inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, _warm: None):
    """Run an inner pytest session in-process; check that it left no hook and no live watcher."""
    pytester.makepyfile(trainlib=TRAINLIB)
    monkeypatch.setenv("COLUMNS", "400")  # short test summary lines in full
    # only this plugin: other installed plugins would be imported afresh by every session
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    before = _global_hooks()

    def run(*args: str) -> pytest.RunResult:
        result = pytester.runpytest_inprocess("-p", "gradwatch.pytest_plugin", "-p", "no:cacheprovider", *args)
        assert _global_hooks() == before, "the plugin left a global module hook installed"
        assert not registry._live, "the plugin left a model watched"
        assert "warnings summary" not in result.stdout.str(), "an inner session raised warnings"
        return result

    return run


def _runs_in_message(output: str) -> list[Path]:
    """Runs named in the failure reports (not again in the short summary, which on CI is untruncated)."""
    failures = output.split("short test summary info")[0]
    return [Path(found) for found in re.findall(r"^model \d+ \(\w+\), run (\S+):$", failures, re.MULTILINE)]


# ------------------------------------------------------------------------------ packaging
def test_entry_point_is_declared() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"gradwatch": "gradwatch.pytest_plugin"}


def test_plugin_module_imports_nothing_heavy() -> None:
    # the parent package is stubbed so that only the plugin module's own imports count
    code = textwrap.dedent(f"""
        import sys, types
        package = types.ModuleType("gradwatch")
        package.__path__ = [{str(ROOT / "gradwatch")!r}]
        sys.modules["gradwatch"] = package
        import gradwatch.pytest_plugin
        print(sorted(m for m in ("torch", "numpy", "pandas") if m in sys.modules))
        print(sorted(m for m in sys.modules if m.startswith("gradwatch.") and m != "gradwatch.pytest_plugin"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout + out.stderr


def test_fail_on_choices_are_the_gates() -> None:
    assert plugin.FAIL_ON == gate.FAIL_ON


def test_run_names_are_safe_and_unique() -> None:
    assert plugin.run_name("tests/test_a.py::TestB::test_c[x/y-1]") == "tests_test_a.py__TestB__test_c_x_y-1"
    long = plugin.run_name("tests/test_a.py::test_" + "z" * 300)
    assert len(long) == 100 and re.fullmatch(r"tests_test_a\.py__test_z+-[0-9a-f]{8}", long)
    settings = plugin._Settings("error", Path("runs"))
    first, again = settings.prefix("t.py::test[a/b]"), settings.prefix("t.py::test[a/b]")
    other = settings.prefix("t.py::test[a_b]")  # sanitises to the same name
    assert first == again == "t.py__test_a_b" and other.startswith("t.py__test_a_b-") and other != first


# ------------------------------------------------------------------------------ verdicts
def test_healthy_training_passes_and_its_runs_are_kept(pytester: pytest.Pytester, run_inner) -> None:
    pytester.makepyfile(test_healthy='''
        from trainlib import make, train

        def test_two_models(gradwatch):
            first = gradwatch.watch(make())
            second = gradwatch.watch(make(), log_every=5)
            for model in (first, second):
                losses = train(model, steps=30)
                assert losses[-1] < losses[0] / 2
            assert len(gradwatch.runs) == 2
    ''')
    for _ in range(2):  # the second session replaces the runs of the first
        result = run_inner("--gradwatch-runs", "kept")
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines(["gradwatch: fail_on=error, runs kept in *kept", "2 runs kept in *kept"])
    kept = pytester.path / "kept"
    assert sorted(p.name for p in kept.iterdir()) == ["test_healthy.py__test_two_models-0",
                                                       "test_healthy.py__test_two_models-1"]
    first, second = (gw.open_run(kept / f"test_healthy.py__test_two_models-{i}") for i in range(2))
    for run in (first, second):
        assert (run.steps, run.status) == (30, "finished")
        assert run.layers == ["features", "fc1", "act", "fc2"]
        assert run.findings().empty
    logged = second.metrics("grad_norm", include_global=False)["step"].unique().tolist()
    assert logged == [0, 5, 10, 15, 20, 25]  # watch(**kwargs) reached the second model's watch


def test_nonfinite_training_fails_naming_kind_step_and_layer(pytester: pytest.Pytester, run_inner) -> None:
    pytester.makepyfile(test_nan='''
        from trainlib import make, train

        def test_poisoned_batch(gradwatch):
            train(gradwatch.watch(make("nan")), poison_step=5)
    ''')
    result = run_inner("-rA")
    result.assert_outcomes(failed=1)
    assert "more below" not in result.stdout.str()
    result.stdout.fnmatch_lines([
        "gradwatch: 1 finding at or above 'error' in the training this test ran",
        "model 0 (Net), run *gradwatch-0:",
        "  step 5 error nonfinite at features (forward): NaN born in `aten::log` at trainlib.py:* "
        "`return torch.log(x)` in the forward pass of features (LogFeatures) at step 5: *; cause: data (only 1 of "
        "the batch's 32 samples went NaN/Inf, by a negative value in the input of log at trainlib.py:*"
        "[[]action: skip[]] Try: *",
        "FAILED test_nan.py::test_poisoned_batch - Failed: gradwatch: 1 finding at or above 'error'*",
    ])
    (path,) = _runs_in_message(result.stdout.str())
    findings = gw.open_run(path).findings()  # the path in the message is the run, readable
    assert findings[["step", "kind", "layer"]].values.tolist() == [[5, "nonfinite", "features"]]


def test_failure_lists_at_most_max_lines_and_counts_the_rest(pytester: pytest.Pytester, run_inner,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_many='''
        import pytest
        from trainlib import make, train

        def test_error_threshold(gradwatch):
            train(make("dead+nan"), poison_step=5)

        @pytest.mark.gradwatch(fail_on="warning")
        def test_warning_threshold():
            train(make("dead+nan"), poison_step=5)
    ''')
    monkeypatch.setattr(plugin, "MAX_LINES", 1)  # the inner session runs in this process, with this module
    result = run_inner()
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "gradwatch: 1 finding at or above 'error' in the training this test ran",
        "model 0 (Net), run *",
        "  step 5 error nonfinite at features (forward): *",
        "  (1 more below 'error' in this run)",
        "(threshold: *",
        "gradwatch: 2 findings at or above 'warning' in the training this test ran",
        "model 0 (Net), run *",
        "  step 5 error nonfinite at features (forward): *",
        "  ... and 1 more",
        "(threshold: *",
    ])


def test_a_model_that_cannot_be_watched_fails_the_test(pytester: pytest.Pytester, run_inner) -> None:
    pytester.makepyfile(test_blocked='''
        import pytest
        import gradwatch as gw
        from trainlib import make, train

        def test_automatic(gradwatch):
            train(make())

        def test_explicit(gradwatch):
            with pytest.raises(gw.RunError):
                gradwatch.watch(make())
    ''')
    (pytester.path / "blocked").write_text("a file where the runs directory should be")
    result = run_inner("-rA", "--gradwatch-runs", "blocked")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["gradwatch: 1 of the models it ran could not be judged",
                                 "model 0 (Net): could not be watched: RunError: *",
                                 "FAILED test_blocked.py::test_automatic - Failed: gradwatch: 1 of the models*"])


def test_warning_findings_fail_only_at_the_warning_threshold(pytester: pytest.Pytester, run_inner) -> None:
    pytester.makepyfile(test_dead='''
        import pytest
        from trainlib import make, train

        @pytest.mark.gradwatch(fail_on="warning")
        def test_marker_warning():
            train(make("dead"))

        @pytest.mark.gradwatch(fail_on="error")
        def test_marker_error():
            train(make("dead"))

        def test_fixture_only(gradwatch):
            train(make("dead"))
    ''')
    dead = ["  step 10 warning dead_units at act: *"]  # fc1's zero gradient is the dead ReLU's (issue 15)

    result = run_inner("-rA")  # default threshold: error
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["gradwatch: 1 finding at or above 'warning' in the training this test ran",
                                 "model 0 (Net), run *", *dead, "FAILED test_dead.py::test_marker_warning - *"])

    result = run_inner("-rA", "--gradwatch-fail-on", "warning")  # the marker still wins over the option
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["PASSED test_dead.py::test_marker_error", "FAILED test_dead.py::test_fixture_only*"])

    pytester.makeini("[pytest]\ngradwatch_fail_on = warning\n")
    result = run_inner("-rA")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["PASSED test_dead.py::test_marker_error", "FAILED test_dead.py::test_fixture_only*"])

    result = run_inner("-rA", "--gradwatch-fail-on", "error")  # the command line wins over the ini file
    result.assert_outcomes(passed=2, failed=1)


def test_marker_alone_watches_and_unmarked_tests_are_untouched(pytester: pytest.Pytester, run_inner) -> None:
    pytester.makepyfile(test_marker='''
        import pytest
        from torch.nn.modules import module
        from gradwatch.watching import registry
        from trainlib import make, train

        @pytest.mark.gradwatch
        def test_marked():
            train(make("nan"), poison_step=5)

        def test_unmarked():
            assert not module._global_forward_pre_hooks and not module._global_forward_hooks
            train(make("nan"), poison_step=5)
            assert not registry._live

        @pytest.mark.gradwatch(fail_on="warning")
        class TestClassMarker:
            @pytest.mark.gradwatch(fail_on="error")  # the closest marker wins
            def test_overridden(self):
                train(make("dead"))

            def test_inherited(self):
                train(make("dead"))
    ''')
    pytester.makeini("[pytest]\ngradwatch_runs = kept\n")
    result = run_inner("-rA", "--strict-markers")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines([
        "PASSED test_marker.py::test_unmarked",
        "PASSED test_marker.py::TestClassMarker::test_overridden",
        "FAILED test_marker.py::test_marked - Failed: gradwatch: 1 finding at or above 'error'*",
        "FAILED test_marker.py::TestClassMarker::test_inherited - Failed: gradwatch: 1 finding at or above 'warning'*",
    ])
    assert sorted(p.name for p in (pytester.path / "kept").iterdir()) == [
        "test_marker.py__TestClassMarker__test_inherited-0",
        "test_marker.py__TestClassMarker__test_overridden-0",
        "test_marker.py__test_marked-0",
    ]


def test_models_the_test_never_hands_over_are_watched(pytester: pytest.Pytester, run_inner) -> None:
    pytester.makepyfile(test_auto='''
        import torch
        from torch import nn
        import gradwatch as gw
        from trainlib import make, train

        def test_created_inside_a_helper(gradwatch):
            train(make("nan"), poison_step=5)

        def test_which_modules_get_a_run(gradwatch, tmp_path):
            generator, critic, evaluated, own = make(), make(), make(), make()
            gw.watch(own, run=tmp_path / "own", console=False)   # the test's own watch is left alone
            with torch.no_grad():
                evaluated(torch.rand(8, 4))                       # inference only: not training
            criterion = nn.MSELoss()                              # no parameters
            optimizer = torch.optim.SGD([*generator.parameters(), *critic.parameters(), *own.parameters()], lr=0.01)
            for _ in range(3):
                x = torch.rand(8, 4)
                loss = criterion(critic(x * generator(x)), x[:, :1]) + own(x).square().mean()
                loss = loss + generator.fc1(x).square().mean()   # a submodule of a watched model, on its own
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            wrapper = nn.Sequential(critic)                       # contains a watched model
            wrapper(torch.rand(8, 4)).sum().backward()
            assert gradwatch.runs == [gw.watcher(generator).run_dir, gw.watcher(critic).run_dir]
            assert [p.name for p in gradwatch.runs] == ["gradwatch-0", "gradwatch-1"]
            for model in (evaluated, generator.fc1, wrapper):
                try:
                    gw.watcher(model)
                except gw.ConfigError:
                    continue
                raise AssertionError(f"{model} was watched")
            assert gw.watcher(own).run_dir == tmp_path / "own"
            gw.unwatch(own)
    ''')
    result = run_inner("-rA")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["model 0 (Net), run *gradwatch-0:",
                                 "  step 5 error nonfinite at features (forward): *",
                                 "FAILED test_auto.py::test_created_inside_a_helper - Failed: gradwatch: 1 finding*"])


def test_fixture_watch_judges_a_model_the_test_watched_itself(pytester: pytest.Pytester, run_inner) -> None:
    pytester.makepyfile(test_explicit='''
        import pytest
        import gradwatch as gw
        from torch import nn
        from trainlib import make, train

        def test_adopted(gradwatch, tmp_path):
            model = gw.watch(make("nan"), run=tmp_path / "mine", console=False)
            assert gradwatch.watch(model) is model
            with pytest.warns(gw.GradwatchWarning, match=r"already watched into .*mine.*ignores .'log_every'."):
                assert gradwatch.watch(model, log_every=2) is model
            assert gradwatch.runs == [tmp_path / "mine"]
            train(model, poison_step=5)

        def test_not_a_module(gradwatch):
            with pytest.raises(TypeError, match="expects a torch.nn.Module instance, got type"):
                gradwatch.watch(nn.Linear)
            with pytest.raises(gw.ConfigError, match="unknown option 'lgo_every'"):
                gradwatch.watch(make(), lgo_every=2)
    ''')
    result = run_inner("-rA")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["model 0 (Net), run *mine:", "  step 5 error nonfinite at features (forward): *"])


def test_a_test_that_fails_on_its_own_reports_only_its_own_failure(pytester: pytest.Pytester, run_inner) -> None:
    pytester.makepyfile(test_own='''
        import pytest
        import gradwatch as gw
        from trainlib import make, train

        def test_own_assertion(gradwatch):
            losses = train(make("nan"), poison_step=5)
            assert losses[-1] < 0, "the loss is never negative"

        @pytest.mark.gradwatch(rules=[gw.Rule(when="nonfinite", do="halt")])
        def test_halted():
            train(make("nan"), poison_step=5)

        def test_healthy_afterwards(gradwatch):
            train(make())
    ''')
    result = run_inner("-rA", "--gradwatch-runs", "kept")
    result.assert_outcomes(passed=1, failed=2)  # failures, not errors at teardown
    output = result.stdout.str()
    result.stdout.fnmatch_lines(["PASSED test_own.py::test_healthy_afterwards",
                                 "FAILED test_own.py::test_own_assertion - AssertionError: the loss is never negative",
                                 "FAILED test_own.py::test_halted - gradwatch.errors.TrainingHalted: gradwatch halted "
                                 "training at step 5: *"])
    assert "at or above" not in output and "step 5 error nonfinite" not in output
    kept = pytester.path / "kept"
    assert gw.open_run(kept / "test_own.py__test_halted-0").status == "halted"
    for name in ("test_own.py__test_own_assertion-0", "test_own.py__test_healthy_afterwards-0"):
        assert gw.open_run(kept / name).status == "finished"  # closed even though the test failed
    assert len(gw.open_run(kept / "test_own.py__test_own_assertion-0").findings()) == 1


# ------------------------------------------------------------------------------ usage errors
@pytest.mark.parametrize(("marker", "message"), [
    ('fail_on="fatal"', "*test_bad.py::test_bad: @pytest.mark.gradwatch(fail_on='fatal'): fail_on must be one of "
                        "'warning', 'error'"),
    ('"error"', "*@pytest.mark.gradwatch takes keyword arguments only*got ('error',)"),
    ('run="runs/x"', "*@pytest.mark.gradwatch(run=...): the plugin names one run per model*"),
])
def test_marker_usage_errors(pytester: pytest.Pytester, run_inner, marker: str, message: str) -> None:
    pytester.makepyfile(test_bad=f'''
        import pytest

        @pytest.mark.gradwatch({marker})
        def test_bad():
            pass
    ''')
    result = run_inner()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])


def test_invalid_watch_option_in_marker_is_a_setup_error(pytester: pytest.Pytester, run_inner) -> None:
    pytester.makepyfile(test_bad='''
        import pytest

        @pytest.mark.gradwatch(log_evry=5)
        def test_bad():
            raise AssertionError("the test body does not run")
    ''')
    result = run_inner("-rA")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["ERROR test_bad.py::test_bad - Failed: gradwatch: @pytest.mark.gradwatch: "
                                 "unknown option 'log_evry' for gw.watch; valid options are: *"])
    assert "the test body does not run" not in result.stdout.str()


def test_invalid_thresholds_in_ini_and_command_line(pytester: pytest.Pytester, run_inner) -> None:
    pytester.makepyfile(test_ok="def test_ok():\n    pass\n")
    result = run_inner("--gradwatch-fail-on", "fatal")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gradwatch-fail-on: invalid choice: 'fatal' (choose from *warning*error*)"])
    pytester.makeini("[pytest]\ngradwatch_fail_on = fatal\n")
    result = run_inner()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: gradwatch_fail_on = 'fatal' in *tox.ini: must be one of warning, error"])
