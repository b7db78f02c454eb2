"""torch.compile in both orders on a GPT trainer: no graph break, and the findings eager mode gives (#26 item 3).

The trainer is written the way the widely copied minimal GPT scripts are: token and position
embeddings, pre-LayerNorm blocks whose causal self-attention is ``F.scaled_dot_product_attention``
with dropout (or, with a key padding mask, written out by hand: mask, softmax, dropout), a GELU
MLP, a head tied to the token embedding, ``forward(idx, targets)`` returning ``(logits, loss)``,
AdamW, and an evaluation pass under ``model.eval()`` and ``torch.no_grad()`` every few steps.
It is watched with the default options (origin tracking on) and takes activation statistics on
sampled steps, where the leaf modules' hooks run. The compiled trainings (each compiled anew, its graph
breaks counted from zero) are given to the tests' pool (``tests/pool.py``) as the module begins; the
eager runs they are compared with train in the test process.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import gradwatch as gw

from . import pool

pytestmark = pytest.mark.slow  # each test compiles a GPT (forward, backward, an evaluation graph)

VOCAB, BLOCK, EMBD, HEADS, LAYERS, BATCH = 64, 16, 32, 4, 2, 4
ORDERS = ["compile-watched", "watch-compiled"]


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)
        self.attn_dropout = nn.Dropout(0.1)
        self.resid_dropout = nn.Dropout(0.1)
        self.register_buffer("causal", torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        if keep is None:  # the fast path
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        else:  # a key padding mask: a query may look at no padding token
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~(self.causal[:T, :T] & keep[:, None, None, :]), float("-inf"))
            y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), keep)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.wpe = nn.Embedding(BLOCK, EMBD)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList([Block() for _ in range(layers)])
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x, keep)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def train(order: str, run: Path, *, steps: int = 6, backend: str = "aot_eager", bf16: bool = False,
          pad_at: int | None = None, scale_at: int | None = None, layers: int = LAYERS, **watch: Any) -> list[float]:
    """Train a fresh GPT watched in ``order`` (``eager``, ``compile-watched``: ``torch.compile(gw.watch(m))``,
    ``watch-compiled``: ``gw.watch(torch.compile(m))``); returns the losses.

    Every third step begins with an evaluation pass. ``pad_at``: from then on each batch comes with a
    key padding mask; at that step sample 1 begins with a padding token, so its first query may look
    at nothing (softmax over a row that is all -inf: NaN). ``scale_at``: that step's loss is scaled by
    1e4 before ``backward()`` (a loss-scaling bug: the gradients explode).
    """
    torch.manual_seed(0)
    model = GPT(layers)
    options: dict[str, Any] = {"run": run, "console": False, **watch}
    if order == "compile-watched":
        called = torch.compile(gw.watch(model, **options), backend=backend)
    elif order == "watch-compiled":
        called = gw.watch(torch.compile(model, backend=backend), **options)
    else:
        called = gw.watch(model, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randint(1, VOCAB, (BATCH, BLOCK + 1), generator=gen)
        x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        if step % 3 == 2:  # estimate the loss, as the scripts do every eval_interval steps
            called.eval()
            with torch.no_grad():
                called(x, y)
            called.train()
        keep = None
        if pad_at is not None and step >= pad_at:
            keep = torch.ones(BATCH, BLOCK, dtype=torch.bool)
            keep[1, 0] = step != pad_at
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = called(x, y, keep)
        assert loss is not None
        optimizer.zero_grad(set_to_none=True)
        (loss * (1e4 if step == scale_at else 1.0)).backward()
        gw.watcher(model).observe(loss=loss)
        optimizer.step()
        losses.append(loss.item())
    gw.unwatch(model)
    return losses


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each run compiles anew, and its graph breaks are counted from zero."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def breaks() -> dict[str, int]:
    """The graph breaks since the counters were cleared, by reason."""
    return {reason.splitlines()[0] + ": " + " ".join(reason.split())[:300]: n
            for reason, n in counters["graph_break"].items()}


def findings(run: Path) -> list[tuple[str, int, str]]:
    """The run's warnings and errors as (kind, step, layer), read back from the store."""
    frame = gw.open_run(run).findings()
    return [(f["kind"], int(f["step"]), f["layer"]) for f in frame.to_dict("records") if f["severity"] != "info"]


def compiled_training(order: str, run: Path, options: dict[str, Any]) -> tuple[list[float], dict[str, int], int]:
    """``train(order, run, **options)`` compiled anew, its graph breaks counted from zero (in the tests' pool):
    the losses, the graph breaks by reason, and the graphs compiled."""
    torch._dynamo.reset()
    counters.clear()
    try:
        losses = train(order, run, **options)
        return losses, breaks(), counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()


#: the compiled training of each test (in each order): ``train``'s options
COMPILED: dict[str, dict[str, Any]] = {
    "test_no_graph_break_on_a_gpt_trainer": {"bf16": True, "sample_every": 2},
    "test_a_nan_under_compile_is_found_where_eager_finds_it": {"steps": 7, "pad_at": 4},
    "test_an_exploding_step_under_compile_is_found_where_eager_finds_it": {"steps": 9, "scale_at": 6,
                                                                           "backend": "eager"},
}
#: what ``compiled`` gives: by (test, order), the compiled training's outcome to come, and its run
Compiled = dict[tuple[str, str], tuple[Future[Any], Path]]


@pytest.fixture(scope="module")
def compiled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compiled]:
    """The compiled trainings of the tests this session runs, given to the tests' pool (two processes beside
    this one) as the module begins."""
    futures: Compiled = {}
    for item in request.session.items:
        name = getattr(item, "originalname", None)
        if getattr(item, "module", None) is request.module and name in COMPILED:
            order = item.callspec.params["order"]  # type: ignore[attr-defined]
            run = tmp_path_factory.mktemp("compiled") / order
            futures[(name, order)] = (pool.submit(compiled_training, order, run, COMPILED[name]), run)
    yield futures
    for future, _ in futures.values():
        future.cancel()  # a session stopped early (-x) trains nothing it no longer tests


@pytest.fixture(scope="module", autouse=True)
def _compiled_as_the_module_begins(compiled: Compiled) -> None:
    """Start the compiled trainings with the module's first test."""


@pytest.mark.parametrize("order", ORDERS)
def test_no_graph_break_on_a_gpt_trainer(tmp_path: Path, order: str, compiled: Compiled) -> None:
    """Default options, bf16 autocast, three sampled steps (leaf hooks on), an evaluation pass: 0 breaks,
    and a healthy run stays as quiet as in eager mode."""
    train("eager", tmp_path / "eager", bf16=True, sample_every=2)
    future, run = compiled[("test_no_graph_break_on_a_gpt_trainer", order)]
    losses, broken, graphs = pool.result(future)
    assert broken == {}, f"graph breaks with {order}"
    # one graph with the leaf hooks on, one with them off, one for the evaluation pass
    assert graphs <= 3
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    acts = gw.open_run(run).metrics("act_norm", include_global=False)
    assert sorted(set(acts.step)) == [0, 2, 4], "the leaf hooks ran on the sampled steps"
    assert findings(run) == findings(tmp_path / "eager") == []


@pytest.mark.parametrize("order", ORDERS)
def test_a_nan_under_compile_is_found_where_eager_finds_it(tmp_path: Path, order: str, compiled: Compiled) -> None:
    """A fully masked attention row at step 4: the same finding (kind, step, layer, op) as in eager mode."""
    train("eager", tmp_path / "eager", steps=7, pad_at=4)
    future, run = compiled[("test_a_nan_under_compile_is_found_where_eager_finds_it", order)]
    _, broken, _ = pool.result(future)
    assert broken == {}, f"graph breaks with {order}"
    eager, found = findings(tmp_path / "eager"), findings(run)
    assert eager[0] == ("nonfinite", 4, "h.0.attn"), eager
    assert found == eager
    ops = [f["root_cause"]["op"] for f in gw.open_run(run).findings().data if f and "root_cause" in f]
    assert ops[:1] == ["aten::_softmax"], ops


@pytest.mark.parametrize("order", ORDERS)
def test_an_exploding_step_under_compile_is_found_where_eager_finds_it(tmp_path: Path, order: str,
                                                                       compiled: Compiled) -> None:
    """The loss of step 6 scaled by 1e4 before backward: the same findings as in eager mode."""
    train("eager", tmp_path / "eager", steps=9, scale_at=6)
    future, run = compiled[("test_an_exploding_step_under_compile_is_found_where_eager_finds_it", order)]
    _, broken, _ = pool.result(future)
    assert broken == {}, f"graph breaks with {order}"
    eager, compiled_found = findings(tmp_path / "eager"), findings(run)
    assert eager == [("exploding", 6, "wte")]
    assert compiled_found == eager
