"""Capability names that plugins share: one plugin provides each, others require or look for it.

Plugins never name each other; they speak through these names (``Declaration.provides`` and
``requires``) and through the mesh. A third-party plugin that provides one of these takes the place of
the first-party plugin that does, and two enabled providers of one name are refused before launch.
"""

PIPELINE = "pipeline"  # splits the model into stages and builds the schedule that runs them
# Runs backward as separate input-gradient and weight-gradient passes (zero-bubble pipeline schedules).
SPLIT_BACKWARD = "split_backward"
TENSOR_PARALLEL = "tensor_parallel"
CONTEXT_PARALLEL = "context_parallel"
# Shards parameters over the data-parallel ranks (dp_shard, flattened with cp when present) and averages
# gradients there: FSDP2 or SimpleFSDP.
DATA_PARALLEL_SHARDING = "data_parallel_sharding"
# Also honours titan_core.data_parallel.replicate_only_over: parameters another plugin has already split
# over part of the data-parallel ranks are sharded over the rest only (FSDP2).
PARTIAL_DATA_PARALLEL = "partial_data_parallel"
EXPERT_PARALLEL = "expert_parallel"  # splits the experts of mixture-of-experts blocks over ranks
COMPILE = "compile"  # compiles the blocks with torch.compile
# Computes in a narrower dtype than the weights are kept in (FSDP's MixedPrecisionPolicy): the core's own mixed
# precision (training.compute_dtype, autocast) then stays off.
MIXED_PRECISION = "mixed_precision"
CHECKPOINTING = "checkpointing"  # saves and restores the training state
