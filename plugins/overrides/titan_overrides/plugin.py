"""Module overrides: a model's modules swapped for faster implementations of the same arithmetic, by name.

``plugins.overrides.modules=[fused_swiglu]``. The model says where its modules are (``ModelDescription.gated_mlp``:
the blocks' SwiGLU feed-forward), never their parameter names; the override keeps every parameter where it was (the
same module objects, under the same names), so initialization, checkpoints, exports and every parallelism plugin see
the model they always saw. An override that cannot run exactly is refused in one line.

``fused_swiglu``: ``down(silu(gate(x)) * up(x))`` with one matrix product for gate and up, their weights
concatenated at each call (2 x ffn x hidden elements copied, beside tokens x hidden x 2 x ffn multiply-adds), and
the activation as one kernel where a compiler makes one: inductor's (a triton kernel on GPUs) with
``activation=compiled``, the default where triton is installed; two eager kernels otherwise, and inside a block the
compile plugin compiles.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from titan_core import TENSOR_PARALLEL, ConfigError, Declaration, GatedMLP, hookimpl, lacks, replace

FIELD = "plugins.overrides"
OVERRIDES = ("fused_swiglu",)  # the overrides this plugin knows, by name
ACTIVATIONS = ("auto", "compiled", "eager")
# Conversions run in stage order: after float8 (150) and LoRA (210) swapped or adapted linears, which a fused
# product would bypass, so that they are found and refused; before FSDP wraps the blocks.
STAGE = 250


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class FusedSwiGLU(nn.Module):
    """A block's SwiGLU with one product for gate and up; its three linears kept as children under their names."""

    def __init__(self, mlp: nn.Module, layout: GatedMLP, activation):
        super().__init__()
        self.names = (layout.gate, layout.up, layout.down)
        for name, child in mlp.named_children():  # in the model's order: its parameters keep theirs
            if name in self.names:
                self.add_module(name, child)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in self.names)
        both = F.linear(x, torch.cat([gate.weight, up.weight]))
        return down(self.activation(*both.chunk(2, dim=-1)))


@hookimpl
def declare():
    return Declaration(stage=STAGE)


@hookimpl
def validate(plugin_config, plan):
    unknown = [name for name in plugin_config.modules if name not in OVERRIDES]
    if unknown or not plugin_config.modules:
        raise ConfigError(f"{FIELD}.modules", f"{unknown[0]!r} is not an override" if unknown else "is empty",
                          f"choose among {', '.join(OVERRIDES)}")
    if plugin_config.activation not in ACTIVATIONS:
        raise ConfigError(f"{FIELD}.activation", f"{plugin_config.activation!r} is not a way to run the activation",
                          f"use one of {', '.join(ACTIVATIONS)}")
    if plan.model.gated_mlp is None:
        raise ConfigError(f"{FIELD}.modules", lacks(plan.model, "gated_mlp", "fused_swiglu"),
                          "remove overrides from +plugins=[...]")
    if plan.provides(TENSOR_PARALLEL):
        # Each rank would concatenate whole gate and up weights, which tensor parallel split as DTensors.
        raise ConfigError(f"{FIELD}.modules", "fused_swiglu does not run under tensor parallel (its product would "
                          "gather the split gate and up weights whole)", "drop fused_swiglu, or tensor parallel")


@hookimpl
def convert_modules(model, plugin_config, plan):
    """overrides: every block's SwiGLU becomes one with a single gate and up product."""
    swap_swiglu(model, plan.model, activation(plugin_config.activation))


def activation(choice: str):
    """SwiGLU's activation: compiled into one kernel (inductor's), or eager."""
    compiled = choice == "compiled" or (choice == "auto" and importlib.util.find_spec("triton") is not None)
    return torch.compile(swiglu, dynamic=True) if compiled else swiglu


def swap_swiglu(model: nn.Module, description, run) -> int:
    """Swap the SwiGLU of every block holding one (a block whose module at ``gated_mlp.module`` has the three linears;
    a mixture of experts' sparse block does not); returns how many. Linears another conversion made something else
    (float8's, LoRA's) are refused: the fused product would bypass them."""
    layout, swapped = description.gated_mlp, 0
    for index, block in description.blocks_of(model).items():
        try:
            mlp = block.get_submodule(layout.module)
            linears = [mlp.get_submodule(name) for name in (layout.gate, layout.up, layout.down)]
        except AttributeError:
            continue
        odd = next((linear for linear in linears if type(linear) is not nn.Linear or len(linear._modules)), None)
        if odd is not None:
            made = (f"Linear carrying {', '.join(odd._modules)}" if type(odd) is nn.Linear else type(odd).__name__)
            raise ConfigError(f"{FIELD}.modules", f"fused_swiglu reads block {index}'s SwiGLU weights as plain "
                              f"linears, and another plugin made one a {made}", "drop fused_swiglu, or the plugin "
                              "converting those linears (float8, lora)")
        if any(linear.bias is not None for linear in linears) or len(list(mlp.parameters())) != 3:
            raise ConfigError(f"{FIELD}.modules", f"block {index}'s module '{layout.module}' holds parameters "
                              "besides its SwiGLU's three weights", "describe as gated_mlp only a bias-free SwiGLU")
        replace(block, layout.module, FusedSwiGLU(mlp, layout, run))
        swapped += 1
    if not swapped:
        raise ConfigError(f"{FIELD}.modules", f"model '{description.family}' has no block holding a SwiGLU at "
                          f"'{layout.module}'", "remove overrides from +plugins=[...]")
    return swapped


@hookimpl
def step_metrics(model_parts):
    """overrides: the blocks this rank runs with a fused SwiGLU."""
    return {"overrides_fused_swiglu_blocks": sum(isinstance(m, FusedSwiGLU) for part in model_parts
                                                 for m in part.modules())}
