"""The NaN replay over sparse tensors (issue 34): a GCN whose adjacency, normalised without self-loops,
holds inf (its nodes of degree 0) is found to be data, the adjacency named with its rows, whether it is
given to ``forward`` (COO or CSR) or kept as a buffer; a healthy sparse GCN raises nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch as gw

NODES, FEATURES, CLASSES = 36, 8, 3
#: nodes 30..35 have no edge: D^-1/2 is inf there
ISOLATED = list(range(30, NODES))


def adjacency(layout: str, self_loops: bool) -> torch.Tensor:
    """A ring over nodes 0..29 (and 6 isolated nodes), normalised D^-1/2 (A [+ I]) D^-1/2, stored sparse;
    without self-loops the isolated nodes' diagonal entries are D^-1/2 = inf."""
    ring = torch.arange(30)
    src, dst = torch.cat([ring, (ring + 1) % 30]), torch.cat([(ring + 1) % 30, ring])
    every = torch.arange(NODES) if self_loops else torch.tensor(ISOLATED)
    index = torch.stack([torch.cat([src, every]), torch.cat([dst, every])])
    degree = torch.zeros(NODES).index_add_(0, src, torch.ones(len(src))) + (1.0 if self_loops else 0.0)
    scale = degree.pow(-0.5)
    values = scale[index[0]] * scale[index[1]]
    values[len(src):] = scale[every]  # a degree-0 node's entry: 0^-1/2
    adj = torch.sparse_coo_tensor(index, values, (NODES, NODES), check_invariants=True).coalesce()
    return adj.to_sparse_csr() if layout == "csr" else adj


class GCN(nn.Module):
    """Two graph convolutions ``adj @ (x W)`` (Kipf & Welling), the adjacency an argument of forward."""

    def __init__(self) -> None:
        super().__init__()
        self.gc1, self.gc2 = nn.Linear(FEATURES, 16), nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.sparse.mm(adj, self.gc1(x)))
        return torch.sparse.mm(adj, self.gc2(h))


class KeptGCN(GCN):
    """The same, the adjacency kept on the model as a buffer."""

    def __init__(self, adj: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("adj", adj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, self.adj)


def train(run: Path, layout: str, self_loops: bool, kept: bool, steps: int = 6) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    adj = adjacency(layout, self_loops)
    model = KeptGCN(adj) if kept else GCN()
    x, y = torch.randn(NODES, FEATURES), torch.randint(0, CLASSES, (NODES,))
    gw.watch(model, run=run, overwrite=True, console=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        out = model(x) if kept else model(x, adj)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        opt.step()
        gw.watcher(model).observe(loss=loss.detach())
    gw.unwatch(model)
    with gw.open_run(run) as opened:
        assert opened.status == "finished" and opened.steps == steps
        return opened.findings().to_dict("records")


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("kept", [False, True], ids=["argument", "buffer"])
def test_an_adjacency_holding_inf_is_named_as_the_cause(tmp_path: Path, layout: str, kept: bool) -> None:
    findings = [f for f in train(tmp_path / "r", layout, self_loops=False, kept=kept) if f["kind"] == "nonfinite"]
    first = findings[0]
    assert first["step"] == 0 and first["severity"] == "error"
    message, data = first["message"], first["data"]
    assert "could not be replayed" not in message, message
    root = data["root_cause"]
    assert root["cause"] == "data", root
    named = root["inputs"]
    assert [n["input"] for n in named] == ["adj"]
    assert named[0]["layout"] == f"sparse {layout.upper()}" and named[0]["inf"] == len(ISOLATED)
    assert named[0]["rows"] == ISOLATED[:5] and named[0]["rows_nonfinite"] == len(ISOLATED)
    assert "cause: data" in message and "'adj'" in message and "30, 31, 32, 33, 34 and 1 more" in message
    if not kept:  # the input itself: nothing of the model is to blame
        assert first["layer"] is None and data.get("source") == "input"
        assert message.startswith(
            "The model's input batch holds NaN/Inf at step 0; cause: data (the input 'adj' (sparse")
        assert data["samples"]["indices"] == ISOLATED  # a node's row of the graph is its sample


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_healthy_sparse_gcn_raises_nothing(tmp_path: Path, layout: str) -> None:
    findings = train(tmp_path / "r", layout, self_loops=True, kept=False, steps=20)
    assert [f for f in findings if f["severity"] != "info"] == []
