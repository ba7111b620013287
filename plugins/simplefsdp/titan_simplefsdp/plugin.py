"""SimpleFSDP: data-parallel sharding written as DTensor code that autograd and the compiler see whole.

Every parameter is stored as a DTensor sharded over the data-parallel mesh. Reading it as a module
attribute (``self.weight``) goes through a parametrization that redistributes it to Replicate (the
all-gather) and hands the module a plain local tensor whose gradient is declared Partial(avg): the
backward of that redistribute is then the reduce-scatter that averages gradients over data-parallel
ranks. No hooks, no side streams: under torch.compile the collectives are ordinary graph nodes.

The parametrization is a property on a per-class subclass (as in the SimpleFSDP reference code), not
``torch.nn.utils.parametrize``: the latter renames ``w.weight`` to ``w.parametrizations.weight.original``,
which would change the canonical names that init seeds, checkpoints and parity checks rely on.
The stored parameter stays in ``_parameters`` under its own name.

With tensor parallel the stored DTensor is 2-D (data parallel x tp). The data-parallel shard takes
the first tensor dimension that tp does not shard, so the two placements commute and the local
piece is simply a data-parallel shard of the tp-local shard.
"""


import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from titan_core import (CP, DATA_PARALLEL_SHARDING, DP_REPLICATE, DP_SHARD, FLOAT_DTYPES, MIXED_PRECISION, TP,
                        Declaration, compute_dtype, float_dtype, hookimpl, replica_count)

STAGE = 600  # last, like FSDP: it shards whatever parameters the earlier transforms produced


@hookimpl
def declare(plugin_config):
    mesh = {DP_SHARD: plugin_config.degree}
    if replica_count(plugin_config.replicate_degree, "plugins.simplefsdp.replicate_degree") != 1:
        mesh[DP_REPLICATE] = plugin_config.replicate_degree
    return Declaration(stage=STAGE, mesh=mesh, provides=frozenset({DATA_PARALLEL_SHARDING, MIXED_PRECISION}))


@hookimpl
def validate(plugin_config):
    if plugin_config.param_dtype is not None:
        float_dtype(plugin_config.param_dtype, "plugins.simplefsdp.param_dtype")
    float_dtype(plugin_config.reduce_dtype, "plugins.simplefsdp.reduce_dtype")


@hookimpl
def apply_parallelism(model_parts, mesh, plugin_config):
    """simplefsdp: store every parameter sharded over the data-parallel mesh, gathered on read."""
    dp_mesh = mesh.submesh(DP_REPLICATE, (DP_SHARD, CP))
    gather = Gather(dp_mesh, mesh.submesh(DP_REPLICATE, (DP_SHARD, CP), TP) if TP in mesh.shape else None,
                    compute_dtype(plugin_config.param_dtype, "plugins.simplefsdp.param_dtype", mesh.device_type),
                    FLOAT_DTYPES[plugin_config.reduce_dtype])
    for part in model_parts:
        for module in list(part.modules()):
            names = [name for name, _ in module.named_parameters(recurse=False)]
            if names:
                for name in names:
                    param = module._parameters[name]
                    module._parameters[name] = nn.Parameter(gather.shard(param), requires_grad=param.requires_grad)
                module.__class__ = gather.parametrized_class(module.__class__, tuple(names))


class Gather:
    """Shards a parameter over the data-parallel mesh, and gathers it back for compute."""

    def __init__(self, dp_mesh, dp_tp_mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype):
        self.dp_mesh, self.dp_tp_mesh = dp_mesh, dp_tp_mesh
        self.replicated = [Replicate()] * dp_mesh.ndim
        self.averaged = [Partial("avg")] * dp_mesh.ndim
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.classes: dict[tuple[type, tuple[str, ...]], type] = {}

    def parametrized_class(self, cls: type, names: tuple[str, ...]) -> type:
        """``cls`` with each of ``names`` read through this gather; one class per (class, names), kept by this run,
        so that torch.compile sees the same type in every block and compiles once."""
        if (cls, names) not in self.classes:
            def prop(name):
                return property(lambda module: self(module._parameters[name]))
            self.classes[cls, names] = type(f"SimpleFSDP{cls.__name__}", (cls,), {name: prop(name) for name in names})
        return self.classes[cls, names]

    def dp_placements(self, dim: int) -> list:
        """Replicated over dp_replicate (hybrid sharding), sharded on ``dim`` over the rest."""
        return [Replicate()] * (self.dp_mesh.ndim - 1) + [Shard(dim)]

    def shard(self, param: torch.Tensor) -> DTensor:
        if not isinstance(param, DTensor):
            return distribute_tensor(param.data, self.dp_mesh, self.dp_placements(0))
        tp_dims = {p.dim for p in param.placements if isinstance(p, Shard)}
        dim = next(d for d in range(param.ndim) if d not in tp_dims)
        return distribute_tensor(param.full_tensor() if not param.is_meta else torch.empty(param.shape, device="meta"),
                                 self.dp_tp_mesh, [*self.dp_placements(dim), *param.placements])

    def __call__(self, param: DTensor) -> torch.Tensor:
        if param.device_mesh == self.dp_mesh:  # equal, not identical: torch caches specs by equal meshes
            return param.redistribute(placements=self.replicated, forward_dtype=self.param_dtype,
                                      backward_dtype=self.reduce_dtype).to_local(grad_placements=self.averaged)
        # 2-D: gather the data-parallel part of the local piece, give back a tp DTensor.
        n_dp = self.dp_mesh.ndim
        dp_view = DTensor.from_local(param.to_local(), self.dp_mesh, param.placements[:n_dp])
        tp_local = dp_view.redistribute(placements=self.replicated, forward_dtype=self.param_dtype,
                                        backward_dtype=self.reduce_dtype).to_local(grad_placements=self.averaged)
        tp_mesh = self.dp_tp_mesh[TP]
        return DTensor.from_local(tp_local, tp_mesh, param.placements[n_dp:], shape=param.shape, stride=param.stride())
