"""Initial weights are drawn box by box: any split of a parameter gives the slices of the whole."""

import pytest
import torch
from torch import nn

from titan_core import initialization
from titan_core.description import ModelDescription, ParamInit
from titan_core.errors import ConfigError


def test_any_box_is_the_slice_of_the_whole(monkeypatch):
    monkeypatch.setattr(initialization, "CHUNK_ELEMENTS", 24)  # 4 rows of 6 per chunk: boxes straddle chunks
    shape, rule = (22, 6), ParamInit.normal(0.5)
    whole = torch.empty(shape)
    initialization.fill_box(whole, (0, 0), shape, "w", rule, seed=7)
    for rows, cols in (((0, 11), (0, 6)), ((11, 22), (0, 3)), ((3, 9), (3, 6)), ((21, 22), (2, 5))):
        box = torch.empty(rows[1] - rows[0], cols[1] - cols[0])
        initialization.fill_box(box, (rows[0], cols[0]), shape, "w", rule, seed=7)
        assert torch.equal(box, whole[rows[0]:rows[1], cols[0]:cols[1]]), (rows, cols)
    other = torch.empty(shape)
    initialization.fill_box(other, (0, 0), shape, "v", rule, seed=7)
    assert not torch.equal(other, whole), "the name must change the draw"
    assert abs(whole.std().item() - 0.5) < 0.15


def test_constants_fill_the_box():
    box = torch.empty(3, 2)
    initialization.fill_box(box, (5, 0), (8, 2), "norm.weight", ParamInit.constant(1.0), seed=0)
    assert torch.equal(box, torch.ones(3, 2))


def test_a_buffer_nobody_fills_is_refused():
    part = nn.Linear(2, 2)
    part.register_buffer("table", torch.empty(3), persistent=False)  # what to_empty leaves: garbage
    description = ModelDescription(family="m", args=None, n_layers=0, param_init=lambda name: ParamInit.normal(0.02),
                                   flops_per_token=lambda seq: 0.0)
    with pytest.raises(ConfigError, match="model 'm' has buffer table but describes no init_buffers"):
        initialization.init_weights(part, description, seed=0)
