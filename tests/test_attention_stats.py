"""The attention statistics (gradwatch.step.attention) against a float64 reference, for every way attention is
called: ``F.scaled_dot_product_attention`` (causal, boolean and additive masks, grouped heads, a scale, 3-D
inputs), ``nn.MultiheadAttention`` (causal and padding masks, separate projections, batch first or not) and a
softmax over hand-written logits; and in a watched run, the scalars each writes per layer.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradwatch as gw
from gradwatch.step import attention


def reference(logits: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head: the largest allowed logit, and the mean over queries (with a key) of the entropy (float64)."""
    z = logits.double().masked_fill(~allowed, -math.inf)
    largest = z.flatten(1).max(1).values
    ents = []
    for h in range(z.shape[0]):
        rows = []
        for i in range(z.shape[1]):
            if allowed[h, i].any():
                p = torch.softmax(z[h, i][allowed[h, i]], -1)
                rows.append(-(p * p.log()).sum())
        ents.append(torch.stack(rows).mean())
    return largest, torch.stack(ents)


def check(values: torch.Tensor, logits: torch.Tensor, allowed: torch.Tensor) -> None:
    heads = logits.shape[0]
    largest, entropy = reference(logits, allowed)
    assert values.shape == (2 * heads,)
    torch.testing.assert_close(values[:heads].double(), largest, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(values[heads:].double(), entropy, rtol=1e-4, atol=1e-4)


def qk(heads: int = 4, kv_heads: int = 4, length: int = 7, keys: int = 7, dim: int = 8, batch: int = 3):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, length, dim, generator=g) * 3
    k = torch.randn(batch, kv_heads, keys, dim, generator=g) * 3
    return q, k, torch.randn(batch, kv_heads, keys, dim, generator=g)


def test_sdpa_causal() -> None:
    q, k, v = qk()
    logits = q[0] @ k[0].transpose(-1, -2) / math.sqrt(8)
    check(attention.sdpa((q, k, v), {"is_causal": True}), logits, torch.ones(4, 7, 7, dtype=torch.bool).tril())


def test_sdpa_boolean_and_additive_masks_and_a_scale() -> None:
    q, k, v = qk(keys=5)
    keep = torch.rand(3, 1, 7, 5, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[..., 0] = True
    logits = q[0] @ k[0].transpose(-1, -2) * 0.5
    check(attention.sdpa((q, k, v), {"attn_mask": keep, "scale": 0.5}), logits, keep[0].expand(4, 7, 5))
    bias = torch.randn(7, 5)
    check(attention.sdpa((q, k, v, bias), {}), q[0] @ k[0].transpose(-1, -2) / math.sqrt(8) + bias,
          torch.ones(4, 7, 5, dtype=torch.bool))


def test_sdpa_grouped_query_heads() -> None:
    q, k, v = qk(heads=8, kv_heads=2)
    logits = q[0] @ k[0].repeat_interleave(4, 0).transpose(-1, -2) / math.sqrt(8)
    values = attention.sdpa((q, k, v), {"is_causal": True, "enable_gqa": True})
    check(values, logits, torch.ones(8, 7, 7, dtype=torch.bool).tril())


def test_sdpa_three_dimensional_inputs_are_one_head() -> None:
    q, k, v = (t[:, 0] for t in qk())
    check(attention.sdpa((q, k, v), {}), (q[0] @ k[0].T / math.sqrt(8))[None], torch.ones(1, 7, 7, dtype=torch.bool))


def test_a_long_sequence_is_measured_on_a_subset_of_its_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "BUDGET", 4 * 7 * 3)  # three queries of each head
    q, k, v = qk()
    values = attention.sdpa((q, k, v), {"is_causal": True})
    rows = torch.tensor([0, 3, 6])
    logits = (q[0] @ k[0].transpose(-1, -2) / math.sqrt(8))[:, rows]
    check(values, logits, torch.ones(7, 7, dtype=torch.bool).tril()[rows].expand(4, 3, 7))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("separate", [False, True])
def test_multihead_attention(batch_first: bool, separate: bool) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, kdim=12 if separate else None,
                                vdim=12 if separate else None)
    x = torch.randn(2, 6, 16)
    kv = torch.randn(2, 5, 12) if separate else torch.randn(2, 5, 16)
    mask = torch.zeros(6, 5, dtype=torch.bool)
    mask[:, 3] = True
    padding = torch.tensor([[False, False, False, False, True], [False] * 5])
    seen = {}

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.multi_head_attention_forward:
                seen["values"] = attention.mha(args, kwargs or {})
            return func(*args, **(kwargs or {}))

    q_in, kv_in = (x, kv) if batch_first else (x.transpose(0, 1), kv.transpose(0, 1))
    with Spy():
        mha(q_in, kv_in, kv_in, attn_mask=mask, key_padding_mask=padding)
    e, d = 16, 4
    if separate:
        w_q, w_k = mha.q_proj_weight, mha.k_proj_weight
    else:
        w_q, w_k = mha.in_proj_weight[:e], mha.in_proj_weight[e:2 * e]
    b_q, b_k = mha.in_proj_bias[:e], mha.in_proj_bias[e:2 * e]
    q = (x[0] @ w_q.T + b_q).reshape(6, 4, d).transpose(0, 1)
    k = (kv[0] @ w_k.T + b_k).reshape(5, 4, d).transpose(0, 1)
    allowed = (~mask & ~padding[0]).expand(4, 6, 5)
    check(seen["values"].detach(), (q @ k.transpose(-1, -2) / math.sqrt(d)).detach(), allowed)


def test_softmax_over_attention_logits_and_nothing_else() -> None:
    z = torch.randn(2, 3, 5, 5) * 4
    z = z.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -math.inf)
    check(attention.softmax((z, -1), {}), z[0], torch.isfinite(z[0]))
    check(attention.softmax((z,), {"dim": 3}), z[0], torch.isfinite(z[0]))
    square = torch.randn(2, 5, 5)
    check(attention.softmax((square, -1), {}), square[:1], torch.ones(1, 5, 5, dtype=torch.bool))
    assert attention.softmax((torch.randn(4, 10), -1), {}) is None  # a router's or a classifier's
    assert attention.softmax((torch.randn(2, 7, 50), -1), {}) is None  # over a vocabulary
    assert attention.softmax((z, 1), {}) is None  # not over the keys


class Block(nn.Module):
    """A causal self-attention block written three ways."""

    def __init__(self, kind: str, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.kind, self.heads = kind, heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mha = nn.MultiheadAttention(d, heads, batch_first=True) if kind == "mha" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        if self.mha is not None:
            return self.mha(x, x, x, attn_mask=causal, need_weights=False)[0]
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        if self.kind == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = (q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)).masked_fill(causal, -math.inf)
            y = F.softmax(a, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.emb, self.attn, self.head = nn.Embedding(50, 32), Block(kind), nn.Linear(32, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.emb(x)))


@pytest.mark.parametrize("kind", ["sdpa", "manual", "mha"])
def test_a_watched_run_records_each_attention_layer_on_sampled_steps(kind: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net(kind)
    gw.watch(model, run=tmp_path / "run", console=False, sample_every=2)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    x = torch.randint(0, 50, (4, 12))
    for _ in range(6):
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        gw.watcher(model).observe(loss=loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    gw.watcher(model).close()
    scalars = gw.open_run(tmp_path / "run").scalars()
    layer = "attn.mha" if kind == "mha" else "attn"
    largest = scalars[f"attn_logit_max/{layer}"]
    assert largest.dropna().index.tolist() == [0, 2, 4]  # sampled steps only
    assert (largest.dropna() > 0).all() and (largest.dropna() < 10).all()
    entropy = scalars[f"attn_entropy/{layer}"].dropna()
    assert ((entropy > 0.5) & (entropy < math.log(12))).all()  # a fresh model attends broadly
    assert set(scalars[f"attn_logit_head/{layer}"].dropna()) <= {0.0, 1.0, 2.0, 3.0}
    assert torch._C._len_torch_function_stack() == 0  # the mode left the stack after each forward call


def test_the_mode_leaves_the_stack_when_the_forward_raises(tmp_path: Path) -> None:
    class Broken(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            super().forward(x)
            raise ValueError("the user's bug")

    model = Broken("sdpa")
    gw.watch(model, run=tmp_path / "run", console=False)
    with pytest.raises(ValueError, match="the user's bug"):
        model(torch.randint(0, 50, (2, 5)))
    assert torch._C._len_torch_function_stack() == 0
    gw.unwatch(model)


def test_attention_false_measures_nothing(tmp_path: Path) -> None:
    model = Net("sdpa")
    gw.watch(model, run=tmp_path / "run", console=False, attention=False)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    x = torch.randint(0, 50, (2, 5))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    gw.watcher(model).close()
    assert not [c for c in gw.open_run(tmp_path / "run").scalars().columns if str(c).startswith("attn")]


@pytest.mark.slow  # importing transformers
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_hugging_face_model_records_each_attention_module(implementation: str, tmp_path: Path) -> None:
    """GPT-2 from a config: its ``eager`` attention's softmax and its ``sdpa`` call each belong to ``h.N.attn``
    (Hugging Face's attention functions are handed the module)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16,
                                     attn_implementation=implementation)
    model = transformers.GPT2LMHeadModel(config)
    gw.watch(model, run=tmp_path / "run", console=False, sample_every=1)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    x = torch.randint(0, 50, (2, 12))
    for _ in range(2):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    gw.watcher(model).close()
    scalars = gw.open_run(tmp_path / "run").scalars()
    layers = sorted(str(c).split("/", 1)[1] for c in scalars.columns if str(c).startswith("attn_logit_max/"))
    assert layers == ["transformer.h.0.attn", "transformer.h.1.attn"]
    entropy = scalars["attn_entropy/transformer.h.0.attn"].dropna()
    assert len(entropy) == 2 and ((entropy > 0.5) & (entropy < math.log(12))).all()


def test_a_model_without_attention_runs_without_the_mode_after_three_sampled_steps(tmp_path: Path) -> None:
    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch._C._len_torch_function_stack())
            return x

    seen: list[int] = []
    model = nn.Sequential(nn.Linear(4, 4), Spy(), nn.Linear(4, 1))
    gw.watch(model, run=tmp_path / "run", console=False, sample_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    model[2] = Block("sdpa", d=4, heads=2)  # a swapped head that attends: looked for again
    for _ in range(2):
        model(torch.randn(2, 3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    gw.watcher(model).close()
    assert seen == [1, 1, 1, 0, 0, 1, 1]


def test_calls_with_more_heads_count_where_a_module_also_makes_a_single_head_softmax(tmp_path: Path) -> None:
    class Twice(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.shape[1]
            F.softmax(torch.zeros(1, t, t), dim=-1)  # a square single-head softmax of its own: logits of 0
            return super().forward(x * 10)

    model = nn.Sequential(nn.Linear(32, 32), Twice("sdpa"))
    gw.watch(model, run=tmp_path / "run", console=False, sample_every=1)
    model(torch.randn(2, 6, 32)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    gw.watcher(model).close()
    scalars = gw.open_run(tmp_path / "run").scalars()
    assert scalars["attn_logit_max/1"].iloc[0] > 1.0  # the 4-head call's, not the single-head one's 0
