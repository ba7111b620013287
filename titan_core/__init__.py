"""titan-core: a PyTorch-native LLM trainer made of a small core and pip-installable plugins.

This package's root is the front door: everything a plugin or model author needs is importable from
``titan_core`` and listed in ``__all__``; nothing else of the core is public. The testing kit (parity
harness, conformance kit, throwaway plugins, a model built and initialized in one process) is
:mod:`titan_core.testing`, a module of its own because it loads pytest.

    the contract      hookimpl, hookspec (titan_core.hookspecs: every hook, typed and documented)
    the plan          Declaration, MeshDimension, Plan, PlannedPlugin, the mesh dimension names, rest_of
    capabilities      PIPELINE, TENSOR_PARALLEL, ... (titan_core.capabilities)
    the model         ModelDescription and its parts, attribute/replace, read_options, lacks, canonical_name,
                      check_hf_config, hf_rope_parameters
    attention seam    causal_attention, masked_attention, attention_mask, shared_mask, route_masked_attention,
                      document_ids, grouped
    positions         rope_frequencies, yarn_frequencies, yarn_mscale
    experts           MoE, MoeOptions, SwiGLU, check_moe_options, ExpertRouting, init_routing_buffers
    the objective     add_loss, IGNORE_INDEX; the optimizer's groups: parameter_role, PARAMETER_ROLES, param_groups
    the run           ParallelMesh, TrainState, Stateful, local_box, device_kind; Tokenizer, Batches, Schedule
    data-parallel     replicate_only_over, replicated_over
    tensor parallel   GatherCasts, cast_gathers, gather_casts, keep_precision (gathered tensors cast to travel)
    options           FLOAT_DTYPES, float_dtype, compute_dtype, count_or_null, text_or_null, replica_count, check_positive
    tools             load_tokenizer, tokenizer_file, special_tokens, model_description, build_meta_model,
                      folder_config, find_chat_template, render_chat; PEFT adapters: peft_updates, uncomputed_field,
                      PEFT_PREFIX, ADAPTER_FILES; library_logs_at_debug, TORCHAO_LOGGERS (start-up chatter)
    errors            ConfigError (bad input: exit 2), StorageError (a full or read-only disk: exit 74)

The planner is a room beside the core with a front door of its own, :mod:`titan_core.planner`, which a plugin's
pricing module imports (training never does).
"""

from titan_core.attention import (attention_mask, causal_attention, document_ids, grouped, masked_attention,
                                  route_masked_attention, shared_mask)
from titan_core.capabilities import (CHECKPOINTING, COMPILE, CONTEXT_PARALLEL, DATA_PARALLEL_SHARDING,
                                     EXPERT_PARALLEL, MIXED_PRECISION, PARTIAL_DATA_PARALLEL, PIPELINE, SPLIT_BACKWARD,
                                     TENSOR_PARALLEL)
from titan_core.data import find_chat_template, load_tokenizer, render_chat, special_tokens, tokenizer_file
from titan_core.data_parallel import replicate_only_over, replicated_over
from titan_core.description import (CORE_ATTENTION, SDPA_CAUSAL, ExpertsLayout, ModelDescription, ParamInit,
                                    TensorParallelLayout, attribute, canonical_name, lacks, read_options, replace)
from titan_core.feed_forward import GatedMLP
from titan_core.errors import EXIT_BAD_INPUT, EXIT_STORAGE, ConfigError, StorageError
from titan_core.narrow_gathers import GatherCasts, cast_gathers, gather_casts, keep_precision
from titan_core.peft import ADAPTER_FILES, PEFT_PREFIX, peft_updates, uncomputed_field
from titan_core.hookspecs import hookimpl, hookspec
from titan_core.huggingface import HFAdapter, StoredLayout, check_hf_config, hf_rope_parameters
from titan_core.initialization import local_box
from titan_core.library_logs import TORCHAO_LOGGERS, library_logs_at_debug
from titan_core.job.model_folder import folder_config
from titan_core.mesh import ParallelMesh, device_kind
from titan_core.moe.layer import MoE, MoeOptions, SwiGLU, check_moe_options
from titan_core.moe.routing import ExpertRouting, init_routing_buffers
from titan_core.objective import IGNORE_INDEX, add_loss
from titan_core.options import (FLOAT_DTYPES, check_positive, compute_dtype, count_or_null, float_dtype,
                                replica_count, text_or_null)
from titan_core.parameter_roles import PARAMETER_ROLES, param_groups, parameter_role
from titan_core.plan import (CP, DP_REPLICATE, DP_SHARD, MESH_DIMS, PP, TP, Declaration, MeshDimension, Plan,
                             PlannedPlugin, rest_of)
from titan_core.plugins import build_meta_model, model_description
from titan_core.protocols import Batches, Schedule, Tokenizer
from titan_core.rope import rope_frequencies, yarn_frequencies, yarn_mscale
from titan_core.train_state import Stateful, TrainState

__version__ = "0.1.0"
__all__ = [
    # the contract, the plan
    "hookimpl", "hookspec", "Declaration", "MeshDimension", "Plan", "PlannedPlugin", "MESH_DIMS", "PP", "DP_REPLICATE",
    "DP_SHARD", "CP", "TP", "rest_of",
    # capabilities
    "CHECKPOINTING", "COMPILE", "CONTEXT_PARALLEL", "DATA_PARALLEL_SHARDING", "EXPERT_PARALLEL", "MIXED_PRECISION",
    "PARTIAL_DATA_PARALLEL", "PIPELINE", "SPLIT_BACKWARD", "TENSOR_PARALLEL",
    # the model
    "ModelDescription", "ParamInit", "TensorParallelLayout", "ExpertsLayout", "HFAdapter", "StoredLayout", "CORE_ATTENTION",
    "SDPA_CAUSAL", "attribute", "replace", "read_options", "lacks", "canonical_name", "check_hf_config", "hf_rope_parameters",
    "GatedMLP",
    # mixture-of-experts building blocks
    "rope_frequencies", "yarn_frequencies", "yarn_mscale", "MoE", "MoeOptions", "SwiGLU", "check_moe_options",
    "ExpertRouting", "init_routing_buffers",
    # the attention seam
    "causal_attention", "masked_attention", "attention_mask", "shared_mask", "route_masked_attention", "document_ids",
    "grouped",
    # the objective, the optimizer's parameter groups
    "add_loss", "IGNORE_INDEX", "parameter_role", "PARAMETER_ROLES", "param_groups",
    # the run (and what hooks pass beyond torch's types), data parallel, options
    "ParallelMesh", "TrainState", "Stateful", "local_box", "device_kind", "Tokenizer", "Batches", "Schedule",
    "replicate_only_over", "replicated_over", "GatherCasts", "cast_gathers", "gather_casts", "keep_precision",
    "FLOAT_DTYPES", "float_dtype", "compute_dtype", "count_or_null", "text_or_null", "replica_count", "check_positive",
    # tools
    "load_tokenizer", "tokenizer_file", "special_tokens", "model_description", "build_meta_model", "folder_config",
    "find_chat_template", "render_chat", "peft_updates", "uncomputed_field", "PEFT_PREFIX", "ADAPTER_FILES",
    # errors; libraries' start-up chatter
    "ConfigError", "StorageError", "EXIT_BAD_INPUT", "EXIT_STORAGE", "library_logs_at_debug", "TORCHAO_LOGGERS",
]
