"""Models that cannot be captured get one clear CaptureError that names the culprit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dapple_ir.errors import CaptureError
from dapple_ir.frontend.capture import capture

THIS = Path(__file__).name


class Inner(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow
            return x * 2
        return x


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.fc(x)).sum()


class BooleanMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y[y > 0].sum()  # a result whose size depends on values


class InPlaceOnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x).sum()


class InPlaceOnView(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, 0] = 0.0
        return x.sum()


class Logits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        return self.fc(x)


class DictWithoutLoss(Logits):
    def forward(self, x: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        return {"logits": self.fc(x)}


class InPlaceInternally(nn.Module):
    """In-place ops on intermediate values are fine and must survive dead-code elimination."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.mul_(3)  # result unused: only its effect on h counts
        return h.sum()


def _x() -> torch.Tensor:
    return torch.randn(2, 4)


def test_data_dependent_control_flow_names_module_line_and_both_methods() -> None:
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (_x(),))
    text = str(info.value)
    assert "with fx and export" in text
    assert "module `inner`" in text
    assert re.search(rf"{THIS}:\d+ `if x.sum\(\) > 0:", text)
    assert "(1) fx failed" in text and "(2) export failed" in text
    assert "data-dependent control flow" in text


def test_fx_only_suggests_export() -> None:
    with pytest.raises(CaptureError, match=r"with fx: .*Try method export"):
        capture(DataDependent(), (_x(),), method="fx")


@pytest.mark.parametrize("method", ["fx", "export"])
def test_dynamic_shape(method: str) -> None:
    with pytest.raises(CaptureError, match=rf"{THIS}:\d+\) has a result whose shape depends on tensor values"):
        capture(BooleanMask(), (_x(),), method=method)


# fx cannot trace item assignment on an input at all; auto falls through to export, which sees it.
@pytest.mark.parametrize(
    ("model", "method"), [(InPlaceOnInput, "fx"), (InPlaceOnInput, "export"), (InPlaceOnView, "auto")]
)
def test_in_place_op_on_an_input(model: type[nn.Module], method: str) -> None:
    with pytest.raises(CaptureError, match=r"modifies its input 'x' in place by `(mul_|setitem|copy_|fill_)`"):
        capture(model(), (_x(),), method=method)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_in_place_op_inside_the_model_is_kept(method: str) -> None:
    torch.manual_seed(0)
    model = InPlaceInternally()
    x = _x()
    captured = capture(model, (x,), method=method, annotate_costs=False)
    torch.testing.assert_close(captured.graph_module(x), model(x))


def test_output_that_is_not_a_scalar_loss() -> None:
    with pytest.raises(CaptureError, match=r"returns f32\[2,3\], not a scalar floating-point loss; give a loss_fn"):
        capture(Logits(), (_x(),))


def test_dict_without_loss() -> None:
    with pytest.raises(CaptureError, match="dict without a 'loss' entry \\(keys: logits\\)"):
        capture(DictWithoutLoss(), (_x(),))


def test_inputs_that_disagree_on_the_batch() -> None:
    with pytest.raises(CaptureError, match=r"disagree on the batch size .*x: 2, target: 3"):
        capture(Logits(), (_x(),), loss_fn=F.cross_entropy, example_targets=(torch.zeros(3, dtype=torch.long),))


def test_bad_arguments() -> None:
    with pytest.raises(CaptureError, match="must be fx, export or auto"):
        capture(Logits(), (_x(),), method="jit")
    with pytest.raises(CaptureError, match=r"needs a torch.nn.Module"):
        capture(lambda x: x, (_x(),))
    with pytest.raises(CaptureError, match="example input 1 is a int"):
        capture(Logits(), (_x(), 3))
    with pytest.raises(CaptureError, match="scalar tensor"):
        capture(Logits(), (torch.tensor(1.0),))
    with pytest.raises(CaptureError, match="no loss_fn"):
        capture(Logits(), (_x(),), example_targets=(_x(),))
