"""Exactness with the library defaults: dropout, Adam on analytically zero gradients, batch norm.

Each test trains a plan (built by `make_plan`, run with the threads transport unless it needs
processes) and compares it with `train_reference`, the original nn.Module trained on one device. The
tests that break the runtime on purpose prove the check is not one that always passes.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dapple_ir.backends.torch import random_draws
from dapple_ir.backends.torch.cores import rank_cores
from dapple_ir.backends.torch.data import microbatch, synthetic_batch
from dapple_ir.backends.torch.launch import run
from dapple_ir.backends.torch.random_draws import StageDraws
from dapple_ir.backends.torch.reference import train_reference
from dapple_ir.backends.torch.runtime import Runtime
from dapple_ir.backends.torch.tolerances import ATOL, RTOL
from dapple_ir.errors import DappleError
from dapple_ir.frontend.model_spec import FactoryResult, load_model_spec
from dapple_ir.plan_dir import load_plan
from tests.test_runtime import CNN, MLP, make_plan

#: Dropout three ways (a module, the functional form, and noise from `randn_like`): every op that draws.
DROPOUT_MODEL = """
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.1)
        self.l2 = nn.Linear(32, 32)
        self.l3 = nn.Linear(32, 32)
        self.l4 = nn.Linear(32, 4)

    def forward(self, x):
        h = self.drop(torch.relu(self.l1(x)))
        h = F.dropout(torch.relu(self.l2(h)), p=0.3, training=self.training)
        h = h + 0.01 * torch.randn_like(h)
        h = F.dropout(torch.relu(self.l3(h)), p=0.5, training=self.training)
        return self.l4(h)


def factory():
    return Net(), (torch.randn(8, 8),), F.mse_loss, (torch.randn(8, 4),)
"""

#: Causal self-attention with its own key projection: softmax ignores the key bias, so its gradient
#: is zero but for rounding, and Adam turns that rounding into full learning-rate steps.
ATTENTION_MODEL = """
import torch
import torch.nn.functional as F
from torch import nn

T, D, H, V = 8, 32, 4, 50


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        q, k, v = (f(x).reshape(-1, T, H, D // H).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(-1, T, D))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.attn = nn.ModuleList(Attention() for _ in range(2))
        self.norm = nn.ModuleList(nn.LayerNorm(D) for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        h = self.emb(idx)
        for norm, attn in zip(self.norm, self.attn):
            h = h + attn(norm(h))
        return self.head(h)


def loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def factory():
    return Net(), (torch.randint(0, V, (4, T)),), loss, (torch.randint(0, V, (4, T)),)
"""

#: Batch norm after three stride-2 convolutions of an 8x8 image: at microbatch size 2 the last one
#: normalises 2 values per channel, the case that amplifies rounding.
SMALL_BATCH_NORM_MODEL = """
import torch
import torch.nn.functional as F
from torch import nn


def block(c_in, c_out):
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(block(3, 8), block(8, 16), block(16, 32))
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.features(x), 1))


def factory():
    return Net(), (torch.randn(8, 3, 8, 8),), F.cross_entropy, (torch.randint(0, 10, (8,)),)
"""


def _spec(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return f"{path}:factory"


# ------------------------------------------------------------------------------------------ dropout


@pytest.mark.parametrize(
    ("replicas", "kind", "split"),
    [
        pytest.param(None, "1f1b", False, id="2-stages-2-ranks"),
        pytest.param([1, 2], "gpipe", False, id="replicated-stage-3-ranks"),
        pytest.param(None, "zb-h1", False, id="split-backward"),
        # Each replica draws its rows of the whole microbatch's masks: the single device's masks.
        pytest.param([3, 1], "1f1b", True, id="microbatch-split-over-3-replicas"),
    ],
)
def test_dropout_training_equals_the_reference(
    tmp_path: Path, replicas: list[int] | None, kind: str, split: bool
) -> None:
    spec = _spec(tmp_path, "dropout", DROPOUT_MODEL)
    plan = make_plan(
        tmp_path / "plan", spec, stages=2, replicas=replicas, kind=kind, optimizer="adam", lr=1e-2, split=split,
        microbatch_size=3 if split else 2,
    )  # fmt: skip
    result = run(plan, steps=3, check=True, transport="threads", timeout=30)
    assert result.check is not None and result.check.ok, result.check
    assert result.check.max_loss_diff <= ATOL
    # Every op that draws was found, in model order: the module, the functional dropouts and randn_like.
    assert len(result.sites) == 4
    order = [op.name for op in load_plan(plan).module.ops]
    assert [order.index(op) for op, _ in result.sites] == sorted(order.index(op) for op, _ in result.sites)


def test_dropout_masks_depend_on_the_microbatch_and_step_not_on_the_split(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "dropout", DROPOUT_MODEL)
    runs = []
    for stages in (2, 3):
        plan = make_plan(tmp_path / f"plan{stages}", spec, stages=stages, optimizer="sgd", lr=0.05)
        runs.append(run(plan, steps=2, transport="threads", timeout=30))
    assert runs[0].losses == runs[1].losses  # the same masks, bit for bit, under another split
    assert runs[0].losses[0] != runs[0].losses[1]


@pytest.mark.parametrize(
    "draw", [torch.rand, lambda n: torch.bernoulli(torch.full((n,), 0.5))], ids=["rand", "bernoulli"]
)
def test_a_draw_depends_on_its_site_only_and_leaves_the_global_generator_alone(draw: Any) -> None:
    # `rand` has no generator argument (the seeded default generator serves it); `bernoulli` takes one.
    before = torch.get_rng_state()

    def drawn(step: int, mb: int, op: str) -> torch.Tensor:
        with random_draws.drawing_in_order(7, step, mb, [(op, 0)], "the test"):
            return draw(64)  # type: ignore[no-any-return]

    first = drawn(3, 1, "dropout")
    assert torch.equal(drawn(3, 1, "dropout"), first)
    assert not torch.equal(drawn(3, 2, "dropout"), first)  # another microbatch
    assert not torch.equal(drawn(4, 1, "dropout"), first)  # another step
    assert not torch.equal(drawn(3, 1, "dropout_1"), first)  # another op
    assert torch.equal(torch.get_rng_state(), before)


def test_a_different_seed_rule_in_the_pipeline_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pipeline seeds its draws as if the run's seed were another: its masks no longer match.
    spec = _spec(tmp_path, "dropout", DROPOUT_MODEL)
    plan = make_plan(tmp_path / "plan", spec, stages=2, optimizer="sgd", lr=0.05)
    seeded = StageDraws.run

    def other_rule(
        self: StageDraws, gm: torch.fx.GraphModule, args: list, seed: int, step: int, mb: int, rows: object = None
    ) -> object:
        return seeded(self, gm, args, seed + 1, step, mb, rows)  # type: ignore[arg-type]

    monkeypatch.setattr(StageDraws, "run", other_rule)
    result = run(plan, steps=1, check=True, transport="threads", timeout=30)
    assert result.check is not None and not result.check.ok
    assert any(line.startswith("loss of step 0") for line in result.check.failures), result.check.failures


def test_a_model_drawing_outside_its_graph_is_named() -> None:
    fewer = r"the reference drew 0 random number\(s\) .* graph draws 1 \(at %dropout\)"
    with (
        pytest.raises(DappleError, match=fewer),
        random_draws.drawing_in_order(0, 0, 0, [("dropout", 0)], "the reference"),
    ):
        torch.ones(2) + 1
    more = "drew more random numbers in microbatch 0 of step 0 than the 0 draw"
    with pytest.raises(DappleError, match=more), random_draws.drawing_in_order(0, 0, 0, [], "the reference"):
        torch.rand(2)


# -------------------------------------------------------------------------- what --check compares


@pytest.mark.slow
def test_adam_on_rounding_noise_is_not_a_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(tmp_path, "attention", ATTENTION_MODEL)
    plan = make_plan(tmp_path / "plan", spec, stages=2, replicas=[2, 1], optimizer="adam", lr=1e-3)
    # Rounding of the size another summation order gives (1e-7 of the largest gradient), added to
    # every gradient before the step: what a different thread count, device or allreduce would do.
    stepping = Runtime.optimizer_step
    noise = torch.Generator().manual_seed(1)

    def rounded_differently(self: Runtime) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        scale = max(float(g.abs().max()) for g in grads)
        for g in grads:
            g.add_((g != 0) * torch.randn(g.shape, generator=noise) * 1e-7 * scale)
        stepping(self)

    monkeypatch.setattr(Runtime, "optimizer_step", rounded_differently)
    result = run(plan, steps=3, check=True, transport="threads", timeout=30)
    assert result.check is not None and result.check.ok, result.check
    loaded = load_model_spec(spec, device="cpu", seed=0)
    assert isinstance(loaded, FactoryResult)
    key_bias = sum(p.numel() for n, p in loaded.model.named_parameters() if n.endswith("k.bias"))
    assert result.check.noise_elements >= key_bias
    # The rule matters: compared plainly, the key biases are far apart (Adam stepped on noise).
    ref = train_reference(
        spec, seed=0, steps=3, microbatches=4, microbatch_size=2, optimizer="adam", lr=1e-3, sites=result.sites
    )
    apart = [
        float((value - ref.params[key.split("/", 1)[1]]).abs().max())
        for tensors in result.params.values()
        for key, value in tensors.items()
        if key.endswith("k.bias")
    ]
    assert max(apart) > 10 * ATOL


def test_a_gradient_off_by_a_thousandth_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Adam is blind to a gradient's scale, so the parameters alone would not show this: the gradients do.
    plan = make_plan(tmp_path / "plan", MLP, stages=2, kind="1f1b", optimizer="adam", lr=1e-3)
    backward = Runtime.backward

    def scaled(self: Runtime, stage: str, mb: int) -> None:
        backward(self, stage, mb)
        if stage == "s1" and mb == 1:
            grad = next(iter(self.stages[stage].params.values())).grad
            assert grad is not None
            grad.mul_(1.001)

    monkeypatch.setattr(Runtime, "backward", scaled)
    result = run(plan, steps=2, check=True, transport="threads", timeout=30)
    assert result.check is not None and not result.check.ok
    assert any(line.startswith("gradient of") and "at step 0" in line for line in result.check.failures)
    assert not any(line.startswith("loss of step 0") for line in result.check.failures)  # the loss cannot see it


def test_a_dropped_microbatch_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan(tmp_path / "plan", MLP, stages=2, kind="1f1b", optimizer="sgd", lr=0.05)
    backward = Runtime.backward

    def dropping(self: Runtime, stage: str, mb: int) -> None:
        if not (stage == "s0" and mb == 3):
            backward(self, stage, mb)

    monkeypatch.setattr(Runtime, "backward", dropping)
    result = run(plan, steps=2, check=True, transport="threads", timeout=30)
    assert result.check is not None and not result.check.ok
    assert any(line.startswith("gradient of") for line in result.check.failures)


# ------------------------------------------------------------------------------------- batch norm


@pytest.mark.slow
def test_batch_norm_statistics_of_an_unreplicated_stage_equal_the_reference(tmp_path: Path) -> None:
    plan = make_plan(tmp_path / "plan", CNN, stages=2, kind="1f1b", optimizer="adam", lr=1e-3)
    result = run(plan, steps=2, check=True, transport="threads", timeout=30)
    assert result.check is not None and result.check.ok, result.check
    assert result.check.averaged_buffers == 0
    ref = train_reference(CNN, seed=0, steps=2, microbatches=4, microbatch_size=2, optimizer="adam", lr=1e-3)
    held = {key.split("/", 1)[1]: value for tensors in result.buffers.values() for key, value in tensors.items()}
    assert held.keys() == ref.buffers.keys()
    for name, value in held.items():
        torch.testing.assert_close(value, ref.buffers[name], rtol=RTOL, atol=ATOL)
    assert int(held["stem.1.num_batches_tracked"]) == 2 * 4  # once per microbatch, as one device does


@pytest.mark.slow
def test_replicas_average_their_running_statistics(tmp_path: Path) -> None:
    # Stage s0 runs on two replicas; each updates its running statistics with its own microbatches
    # (m % 2), then the replicas average them. Computed here from the eager model, independently.
    plan = make_plan(tmp_path / "plan", CNN, stages=2, replicas=[2, 1], kind="1f1b")
    result = run(plan, steps=1, check=True, transport="threads", timeout=30)
    assert result.check is not None and result.check.ok, result.check
    assert result.check.averaged_buffers > 0
    loaded = load_model_spec(CNN, device="cpu", seed=0)
    assert isinstance(loaded, FactoryResult)
    inputs, _ = synthetic_batch(loaded.example_inputs, loaded.example_targets, 8, 0, 0)
    replicas = []
    for first in (0, 1):
        model = copy.deepcopy(loaded.model).train()
        with torch.no_grad():
            for mb in range(first, 4, 2):
                model(*microbatch(inputs, mb, 2))
        replicas.append(dict(model.named_buffers()))
    held = {rank: tensors for rank, tensors in result.buffers.items() if any(k.startswith("s0/") for k in tensors)}
    assert len(held) == 2
    compared = 0
    for tensors in held.values():
        for key, value in tensors.items():
            name = key.split("/", 1)[1]
            if name.endswith(("running_mean", "running_var")):
                expected = (replicas[0][name].double() + replicas[1][name].double()) / 2
                torch.testing.assert_close(value, expected.float(), rtol=1e-6, atol=1e-7)
                compared += 1
    assert compared > 0


def test_replicated_batch_norm_over_two_values_is_explained(tmp_path: Path) -> None:
    # Two values per channel amplify the allreduce's other summation order into another training:
    # the check says so, and that the first step agreed.
    spec = _spec(tmp_path, "small_bn", SMALL_BATCH_NORM_MODEL)
    plan = make_plan(tmp_path / "plan", spec, stages=1, replicas=[2], kind="1f1b", optimizer="sgd", lr=0.1)
    result = run(plan, steps=3, check=True, transport="threads", timeout=30)
    assert result.check is not None and not result.check.ok
    assert any("the first step agrees" in note for note in result.check.notes), result.check.notes
    assert any("batch norm features.2.1 normalises over only 2 value(s)" in n for n in result.check.notes)


@pytest.mark.slow
def test_unreplicated_batch_norm_over_two_values_is_exact_under_torchrun(tmp_path: Path) -> None:
    # Worker processes run one intra-op thread; the reference must too, or its kernels round
    # differently and the two values per channel amplify that into a mismatch.
    spec = _spec(tmp_path, "small_bn", SMALL_BATCH_NORM_MODEL)
    plan = make_plan(tmp_path / "plan", spec, stages=2, kind="1f1b", optimizer="adam", lr=1e-3)
    result = run(plan, steps=3, check=True, transport="torchrun", timeout=60, device="cpu")
    assert result.check is not None and result.check.ok, result.check
    assert result.check.max_loss_diff == 0.0
    # Exact with each rank pinned to cores of its own where this machine has a core per rank.
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    assert result.cores == [rank_cores(r, 2, usable) if usable else None for r in range(2)]
    # Each step's period from the ranks' own reports: the last rank done with it, less the last done with the one
    # before (the first step from the first rank's start).
    times = [json.loads((plan / "run" / f"rank_{r}.json").read_text())["step_times"] for r in range(2)]
    ends = [max(t[str(k)][1] for t in times) for k in range(3)]
    first = min(t["0"][0] for t in times)
    assert result.step_s == pytest.approx([ends[0] - first, ends[1] - ends[0], ends[2] - ends[1]])
