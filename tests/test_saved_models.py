"""A watched model saved whole loads the way PyTorch >= 2.6 asks: nothing of gradwatch in the file (issue 26, 2).

The word-language-model example saves its best model with ``torch.save(model, f)`` in the middle of
training and reloads it weights-only with ``torch.serialization.safe_globals([RNNModel, nn.LSTM, ...])``.
"""

from __future__ import annotations

import copy
import io
import pickle
import pickletools
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch as gw
from gradwatch.watching import guard


class RNNModel(nn.Module):
    """The word-language-model example's model: encoder, LSTM, dropout, decoder."""

    def __init__(self, ntoken: int = 20, ninp: int = 8, nhid: int = 8) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.drop(self.encoder(x)))
        return self.decoder(self.drop(out))


SAFE = [RNNModel, nn.LSTM, nn.Dropout, nn.Embedding, nn.Linear]


def _globals(data: bytes) -> list[str]:
    """The globals a ``torch.save`` file's pickle names."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    names, strings = [], []
    for op, arg, _ in pickletools.genops(pkl):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "GLOBAL":
            names.append(str(arg).replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            names.append(".".join(strings[-2:]))
    return names


def _hooks(model: nn.Module) -> int:
    """gradwatch's hooks (or their stand-ins) on a model."""
    found = 0
    for m in model.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            found += sum(isinstance(h, guard.Hook) or h is guard.unwatched for h in hooks.values())
    return found


@pytest.mark.parametrize("when", ["after the step", "mid-iteration, leaf and output hooks attached"])
def test_a_watched_model_saved_whole_loads_weights_only(tmp_path: Path, when: str) -> None:
    torch.manual_seed(0)
    model = gw.watch(RNNModel(), run=tmp_path / "run", console=False, sample_every=1)  # leaves hooked every step
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = torch.randint(0, 20, (6, 4))
    saved = b""
    for step in range(4):
        out = model(data)
        loss = nn.functional.cross_entropy(out.flatten(0, 1), data.flatten())
        if step == 2 and when.startswith("mid"):
            assert _hooks(model) > 2, "the sampled step's leaf hooks are attached"
            buffer = io.BytesIO()
            torch.save(model, buffer)  # the best model so far, saved as the example does
            saved = buffer.getvalue()
        opt.zero_grad()
        loss.backward()
        gw.watcher(model).observe(loss=loss)
        opt.step()
        if step == 2 and not saved:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            saved = buffer.getvalue()
    assert b"gradwatch" not in saved, [g for g in _globals(saved) if "gradwatch" in g]
    assert not [g for g in _globals(saved) if g.startswith("gradwatch")]
    with torch.serialization.safe_globals(SAFE):
        loaded = torch.load(io.BytesIO(saved))  # weights_only=True, PyTorch's default
    assert _hooks(loaded) == 0 and not loaded._forward_pre_hooks_with_kwargs, "the copy is not watched"
    assert gw.watcher(model).step == 4 and not gw.watcher(model).detached, "the original is still watched"
    model.eval()
    loaded.eval()
    assert loaded.decoder.weight.shape == model.decoder.weight.shape
    assert torch.isfinite(loaded(data)).all()
    gw.unwatch(model)
    with gw.open_run(tmp_path / "run") as run:
        assert run.steps == 4 and run.status == "finished"


def test_copies_hold_no_hook_of_gradwatch_and_the_original_keeps_its_own(tmp_path: Path) -> None:
    model = gw.watch(RNNModel(), run=tmp_path / "run", console=False)
    hooks = _hooks(model)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)),
                   torch.optim.swa_utils.AveragedModel(model).module):
        assert _hooks(copied) == 0
        assert all(not p._post_accumulate_grad_hooks for p in copied.parameters())
    assert _hooks(model) == hooks
    gw.unwatch(model)


def test_other_ordered_dicts_pickle_as_before() -> None:
    state = nn.Linear(2, 2).state_dict()  # an OrderedDict with attributes of its own (_metadata)
    again = pickle.loads(pickle.dumps(state))
    assert list(again) == list(state) and again._metadata == state._metadata
    plain = OrderedDict([(1, True), (2, "x")])
    assert pickle.loads(pickle.dumps(plain)) == plain and copy.deepcopy(plain) == plain
