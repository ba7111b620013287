"""CUDA's autocast policy for the ops where it differs from CPU's, applied to a trace on CPU tensors.

The planner traces a job under the core's autocast on fake CPU tensors (meta tensors have no autocast, and a
build without CUDA makes no fake CUDA tensors). CUDA's autocast runs some ops in float32 that CPU's leaves in the
narrow dtype: norms, ``pow``, ``rsqrt``, ``exp``, ``softmax``, ``sum``... A Qwen3 block's query and key norms, fed a
linear's bfloat16 output, then make float32 results on a GPU, and autograd keeps their float32 inputs. While a
CUDA job is traced, :func:`cuda_autocast_policy` gives those ops CPU autocast kernels that do what CUDA's do:
widen their narrow floating inputs to float32, or, for the reductions and softmaxes, ask for a float32 result.
An op counts only where torch registers an AutocastCUDA kernel and no AutocastCPU one, so a CPU kernel torch
adds later is never overridden.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree

# torch's lists of ops CUDA's autocast runs in float32 (aten/src/ATen/autocast_mode.h: the "fp32" policy, which
# casts the inputs, and the "fp32_set_opt_dtype" one, which asks the op for a float32 result).
FLOAT32_INPUTS = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
                  "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
                  "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
                  "nuclear_norm.dim", "cosine_similarity", "dist", "pdist", "renorm", "logsumexp")
FLOAT32_RESULT = ("softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
                  "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
NARROW = (torch.bfloat16, torch.float16)


def differs_on_cpu(name: str) -> bool:
    """Whether CUDA's autocast has a kernel for ``aten::name`` and CPU's has none."""
    qualified = f"aten::{name}"
    return (torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "AutocastCUDA")
            and not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "AutocastCPU"))


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _below_autocast():
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def _widened(op):
    """``op`` run on float32 copies of its narrow floating inputs, as CUDA's "fp32" policy runs it."""
    def widen(value):
        return value.float() if isinstance(value, torch.Tensor) and value.dtype in NARROW else value

    def kernel(*args, **kwargs):
        with _below_autocast():
            return op(*pytree.tree_map(widen, args), **pytree.tree_map(widen, kwargs))
    return kernel


def _float32_result(op):
    """``op`` asked for a float32 result when its input is narrow and it was given no dtype, as CUDA's
    "fp32_set_opt_dtype" policy runs it."""
    arguments = op._schema.arguments
    index = next(i for i, argument in enumerate(arguments) if argument.name == "dtype")

    def kernel(*args, **kwargs):
        if args[0].dtype in NARROW:
            if arguments[index].kwarg_only:
                kwargs = {**kwargs, "dtype": kwargs.get("dtype") or torch.float32}
            elif len(args) <= index or args[index] is None:
                args = (*args[:index], torch.float32, *args[index + 1:])
        with _below_autocast():
            return op(*args, **kwargs)
    return kernel


@contextlib.contextmanager
def cuda_autocast_policy():
    """While open, CPU autocast runs the ops where CUDA's differs as CUDA's runs them."""
    library = torch.library.Library("aten", "IMPL")
    try:
        for names, policy in ((FLOAT32_INPUTS, _widened), (FLOAT32_RESULT, _float32_result)):
            for name in filter(differs_on_cpu, names):
                library.impl(name, policy(_overload(name)), "AutocastCPU")
        yield
    finally:
        library._destroy()
