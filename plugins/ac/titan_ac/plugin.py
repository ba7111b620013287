"""Activation checkpointing: blocks keep few of their activations and recompute the rest in backward.

* ``full``: a checkpointed block keeps only its inputs and reruns its whole forward in backward.
* ``selective_op``: every block keeps the results of the expensive ops (``save_ops``, by default the
  matmuls and attention) and recomputes only the cheap elementwise ones (norms, RoPE, SwiGLU).
* ``selective_layer``: full checkpointing of every ``every``-th block; the others keep everything.

The blocks the model describes (``ModelDescription.blocks``) are wrapped in place; the wrapper's ``_checkpoint_wrapped_module.`` name
segment is one the core strips from parameter names, so init and checkpoints see the usual names.
"""

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from titan_core import SPLIT_BACKWARD, ConfigError, Declaration, hookimpl, lacks

STAGE = 400  # after TP/CP rewrote the block, so recomputation replays their collectives too; before compile
MODES = ("full", "selective_op", "selective_layer")
MATMUL_POLICIES = ("all", "every_other")  # of the matmuls save_ops names, keep all or the 1st, 3rd, ... (TorchTitan's)
MATMULS = ("mm", "_scaled_mm", "addmm")
# Profiler ranges are markers, not results. FSDP opens them in its hooks, which run a different number of
# times in forward and in recomputation when an FSDP unit sits inside a checkpointed block (expert
# parallel's experts): counted as ops, they failed backward with "invocation index ... not found".
# Waits on functional collectives are lazy (on a result's first use), so a compiled region and its
# recomputation need not wait the same number of times (tp x ep x compile failed the same way); the
# collective itself stays counted and is saved or rerun like any op. An FSDP unit of one rank (expert parallel's
# experts when ep takes every dp_shard rank) unshards by a copy_ inside the block, in recomputation even where
# forward found the parameters unsharded (a pipeline with reshard_after_forward=always failed "aten.copy_.default
# encountered during backward but not found in storage"); the policy below never saves a mutable op, so copy_
# is rerun either way and only its count is skipped.
SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_exit._RecordFunction,
                        torch.ops._c10d_functional.wait_tensor.default, torch.ops.aten.copy_.default})


@hookimpl
def declare():
    """ac: its stage, and which options act only in one mode."""
    selective_op = ("plugins.ac.mode=selective_op", lambda options, config: options.mode == "selective_op")
    return Declaration(stage=STAGE, acts_only={
        "every": ("plugins.ac.mode=selective_layer", lambda options, config: options.mode == "selective_layer"),
        "save_ops": selective_op, "matmuls": selective_op})


@hookimpl
def validate(plugin_config, plan):
    """ac: the mode, the blocks to wrap, the ops to keep and the matmul policy, before launch."""
    if plan.model.blocks is None:
        raise ConfigError("plugins.ac", lacks(plan.model, "blocks", "activation checkpointing"),
                          "remove ac from +plugins=[...], or describe the model's blocks")
    if plugin_config.mode not in MODES:
        raise ConfigError("plugins.ac.mode", f"unknown mode '{plugin_config.mode}'", f"use one of {', '.join(MODES)}")
    if plugin_config.every < 1:
        raise ConfigError("plugins.ac.every", f"{plugin_config.every!r} is not a positive integer",
                          "checkpoint every k-th block with k >= 1 (1: every block)")
    if plugin_config.mode == "selective_op" and plan.provides(SPLIT_BACKWARD):
        # Found by the stack matrix: torch refuses a second backward through a selectively checkpointed
        # region ("Trying to backward an extra time"), and split backward runs two.
        raise ConfigError("plugins.ac.mode", "selective_op cannot run under a pipeline schedule that splits backward "
                          "into input- and weight-gradient passes (torch allows one backward per region)",
                          "use mode=full or selective_layer, or a schedule that does not split backward")
    if plugin_config.mode == "selective_op":
        unknown = [op for op in plugin_config.save_ops if not hasattr(torch.ops.aten, op)]
        if unknown:
            raise ConfigError("plugins.ac.save_ops", f"'{unknown[0]}' is not an aten op",
                              "name ops as in torch.ops.aten (e.g. mm, _scaled_dot_product_flash_attention)")
    if plugin_config.matmuls not in MATMUL_POLICIES:
        raise ConfigError("plugins.ac.matmuls", f"unknown policy '{plugin_config.matmuls}'",
                          f"use one of {', '.join(MATMUL_POLICIES)}")


@hookimpl
def apply_parallelism(model_parts, plugin_config, plan):
    """ac: wrap every block (or every k-th) of every model part in a checkpoint."""
    for part in model_parts:
        apply_ac(plan.model.blocks_of(part), plugin_config.mode, plugin_config.every, plugin_config.save_ops,
                 plugin_config.matmuls)


def apply_ac(layers: torch.nn.ModuleDict, mode: str, every: int = 1, save_ops=(), matmuls: str = "all") -> None:
    """Wrap the blocks of ``layers`` in place. Keys are the global layer indices (a pipeline stage keeps
    them), so ``every`` picks the same blocks whatever the split."""
    for name, block in list(layers.items()):
        if mode == "selective_layer" and int(name) % every:
            continue
        context = {"context_fn": keep_results_of(save_ops, matmuls)} if mode == "selective_op" else {}
        # No dropout in these models, so the RNG state need not be saved and restored around recomputation.
        layers[name] = checkpoint_wrapper(block, preserve_rng_state=False, **context)


def keep_results_of(op_names, matmuls: str = "all"):
    """A checkpoint ``context_fn`` that saves the outputs of the named aten ops and recomputes the rest; with
    ``matmuls="every_other"`` only the 1st, 3rd, ... of a block's matmuls among them."""
    saved = {getattr(torch.ops.aten, name) for name in op_names}
    alternating = {getattr(torch.ops.aten, name) for name in MATMULS} if matmuls == "every_other" else set()

    def contexts():
        seen = {False: 0, True: 0}  # matmuls met in the forward and in its recomputation, which must agree

        def policy(ctx, op, *args, **kwargs):
            # Only functional overloads: inside a compiled region (tp + compile compiles sub-layers inside the
            # checkpointed block) inductor calls ``mm.out`` into buffers it reuses, and a saved buffer that is
            # later overwritten fails backward ("Tensor cached during selective activation checkpoint has been
            # mutated"). Those results are recomputed instead.
            keep = op.overloadpacket in saved and not op._schema.is_mutable
            if keep and op.overloadpacket in alternating:
                seen[ctx.is_recompute] += 1
                keep = seen[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)
    return contexts
