"""Matrix axis: layouts — sparse COO and CSR inputs and buffers, sparse gradients, channels_last, views, jagged."""

from __future__ import annotations

import torch
from torch import nn

from tests.matrix import Cell, Loop, Observe
from tests.matrix.loops import mlp, poisoned, supervised

NODES = 12


def adjacency(layout: torch.layout) -> torch.Tensor:
    """A ring graph's normalised adjacency with self-loops (``D^-1/2 (A + I) D^-1/2``), in ``layout``."""
    idx = torch.arange(NODES)
    rows = torch.cat([idx, idx, idx])
    cols = torch.cat([idx, (idx + 1) % NODES, (idx - 1) % NODES])
    values = torch.full((rows.numel(),), 1.0 / 3.0)
    adj = torch.sparse_coo_tensor(torch.stack([rows, cols]), values, (NODES, NODES)).coalesce()
    return adj.to_sparse_csr() if layout == torch.sparse_csr else adj


class GraphConv(nn.Module):
    """``adj @ (x W)`` with a sparse adjacency passed in (the GCN layer of Kipf and Welling)."""

    def __init__(self, features: int, out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, out)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(adj, self.linear(x))


class GCN(nn.Module):
    def __init__(self, layout: torch.layout, buffer: bool) -> None:
        super().__init__()
        self.conv1, self.act, self.conv2 = GraphConv(4, 16), nn.ReLU(), GraphConv(16, 1)
        self.buffer = buffer
        if buffer:
            self.register_buffer("adj", adjacency(layout))
        self._adj = adjacency(layout)

    def forward(self, x: torch.Tensor, adj: torch.Tensor | None = None) -> torch.Tensor:
        adj = self.adj if self.buffer else (self._adj if adj is None else adj)
        return self.conv2(self.act(self.conv1(x, adj)), adj)


def gcn(layout: torch.layout, buffer: bool) -> Loop:
    model = GCN(layout, buffer)

    def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(3000 + i)
        x = torch.randn(NODES, 4, generator=g)
        return x, x[:, :1] + torch.roll(x[:, 1:2], 1, 0)

    return supervised(model, data=data, forward=lambda m, x: m(x) if buffer else m(x, m._adj))


def sparse_embedding() -> Loop:
    """``nn.Embedding(sparse=True)`` trained by ``SparseAdam`` (word2vec's recipe): sparse gradients."""
    model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Flatten(), nn.Linear(24, 1))
    dense = [p for n, p in model.named_parameters() if not n.startswith("0.")]

    def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(4000 + i)
        ids = torch.randint(0, 50, (16, 3), generator=g)
        return ids, (ids.float().mean(1, keepdim=True) / 25 - 1)

    sparse_opt = torch.optim.SparseAdam(list(model[0].parameters()), lr=0.01)
    dense_opt = torch.optim.Adam(dense, lr=0.01)

    def step(i: int, poison: bool, observe: Observe) -> None:
        ids, y = data(i)
        out = model(ids)
        if poison:
            out = poisoned(out)
        loss = (out - y).pow(2).mean()
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        observe(loss=loss)
        sparse_opt.step()
        dense_opt.step()

    return Loop(model, step)


def channels_last() -> Loop:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 1))
    model = model.to(memory_format=torch.channels_last)

    def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(5000 + i)
        x = torch.randn(8, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
        return x, x.mean((1, 2, 3)).unsqueeze(1)

    return supervised(model, data=data, lr=0.05)


class Views(nn.Module):
    """Non-contiguous weights (a transposed parameter) applied to transposed and expanded inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 4).t() / 2)  # stored (4, 16) transposed: not contiguous
        self.act = nn.Tanh()
        self.out = nn.Linear(16, 1)

    def forward(self, xt: torch.Tensor) -> torch.Tensor:
        x = xt.t()  # (batch, 4), a view
        scale = torch.ones(1, 1).expand(x.shape[0], 4)  # an expanded view
        return self.out(self.act((x * scale) @ self.weight))


def views() -> Loop:
    def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(6000 + i)
        x = torch.randn(4, 16, generator=g)
        return x, x.sum(0).unsqueeze(1)
    return supervised(Views(), data=data)


def jagged() -> Loop:
    """A jagged nested tensor of variable-length sequences through Linear layers, averaged per sequence."""
    model = mlp(torch.float32, out=1)

    def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(7000 + i)
        lengths = [2 + (i + k) % 5 for k in range(16)]
        seqs = [torch.randn(n, 4, generator=g) for n in lengths]
        x = torch.nested.nested_tensor(seqs, layout=torch.jagged)
        return x, torch.stack([s[:, :2].sum(1).mean() for s in seqs]).unsqueeze(1)

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = m(x)
        return torch.stack([t.mean(0) for t in out.unbind()])

    def poison(x: torch.Tensor) -> torch.Tensor:
        seqs = list(x.unbind())
        seqs[0] = poisoned(seqs[0])
        return torch.nested.nested_tensor(seqs, layout=torch.jagged)

    return supervised(model, data=data, forward=forward, poison=poison)


CELLS = [
    *[Cell(f"layouts/{name}-{'buffer' if buffer else 'input'}",
           lambda layout=layout, buffer=buffer: gcn(layout, buffer))
      for name, layout in (("sparse-coo", torch.sparse_coo), ("sparse-csr", torch.sparse_csr))
      for buffer in (False, True)],
    Cell("layouts/sparse-embedding-gradients", sparse_embedding, reference=False),
    Cell("layouts/channels-last", channels_last),
    Cell("layouts/non-contiguous-and-expanded-views", views),
    Cell("layouts/jagged-nested-input", jagged),
]
