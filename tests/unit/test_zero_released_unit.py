"""A released ZeRO 3 parameter (hpctrain/comm/released.py): its metadata, gradient and hooks answer, every read
of its values raises one line naming it and its unit, and a gathered one is a plain nn.Parameter again."""

from __future__ import annotations

import pytest
import torch

from hpctrain.base.errors import ConfigError
from hpctrain.comm.released import mark_gathered, mark_released, name_parameters


def released_linear() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4))
    name_parameters(model, [(model[0], list(model[0].parameters()), False)])
    for p in model.parameters():
        mark_released(p)
    return model


def test_a_released_parameter_answers_its_metadata_gradient_and_a_move_to_where_it_is() -> None:
    model = released_linear()
    w = model[0].weight
    assert isinstance(w, torch.nn.Parameter) and type(w) is not torch.nn.Parameter
    assert (w.shape, w.dtype, w.device.type, w.numel(), w.dim(), w.requires_grad, w.is_leaf) == (
        torch.Size([4, 3]), torch.float32, "cpu", 12, 2, True, True)
    w.grad = torch.ones(4, 3)
    assert float(w.grad.sum()) == 12.0
    model.zero_grad()
    assert w.grad is None
    model.to("cpu")  # where it is already: nothing is read
    model.train()


@pytest.mark.parametrize("read", [
    lambda m: m(torch.ones(2, 3)),
    lambda m: torch.nn.functional.linear(torch.ones(2, 3), m[0].weight),
    lambda m: torch.isnan(m[0].weight),
    lambda m: m[0].weight.sum(),
    lambda m: m[0].weight.T,
    lambda m: m.state_dict(),
    lambda m: m.to(torch.float64),
    lambda m: repr(m[0].weight),
])
def test_every_read_of_a_released_parameter_raises_one_line_naming_it_and_its_unit(read) -> None:
    with pytest.raises(ConfigError) as error:
        read(released_linear())
    message = str(error.value)
    assert "parameter '0.weight' of unit '0'" in message and "\n" not in message, message


def test_a_gathered_parameter_is_a_plain_parameter_again() -> None:
    model = released_linear()
    for p in model.parameters():
        mark_gathered(p)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert model(torch.ones(2, 3)).shape == (2, 4)
    subclass = type("Custom", (torch.nn.Parameter,), {})
    p = subclass(torch.ones(2))
    mark_released(p)  # another class keeps its own (it reads the NaN placeholder)
    assert type(p) is subclass
