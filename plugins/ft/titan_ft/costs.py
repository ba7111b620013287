"""ft's pricing: the gradients' all-reduce across replica groups every step (sync), or the weights' every
``sync_every`` steps (local_sgd, diloco), over the network between the groups; the quorum's messages."""

import math

from titan_core import hookimpl
from titan_core.planner import ACROSS_JOBS
from titan_ft.agreement import PARTS
from titan_ft.plugin import BUCKET_BYTES


@hookimpl
def estimate_costs(ledger, plugin_config, plan):
    """ft: a ring all-reduce of what this rank keeps of the gradients (sync) or of the weights, once per sync
    (local_sgd, diloco), between the same rank of every group; DiLoCo's outer momentum. The quorum (overlapped with
    forward) and the commit vote cost a round trip each: torchft's messages, one answer listing every group; the
    groups' table of option digests, one all-reduce per quorum. DiLoCo's
    copy of the weights as last synchronized lives in host memory, not the device's."""
    groups, sync = plan.replica_group[1], plugin_config.mode == "sync"
    every = 1 if sync else plugin_config.sync_every

    def kept_bytes(rank):  # float32 gradients or weights this rank keeps after every split
        return 4 * (rank.trained_params if sync else rank.kept_params)
    ledger.add_collective(f"{'gradients' if sync else 'weights'} averaged across {groups} replica groups",
                          (ACROSS_JOBS,), lambda rank: 2 * kept_bytes(rank) * (groups - 1) / groups / every,
                          overlapped=False,
                          # torchft's LocalSGD and DiLoCo all-reduce each parameter on its own
                          calls=lambda rank: (math.ceil(kept_bytes(rank) / BUCKET_BYTES) if sync
                                              else rank.model.parameter_tensors) / every)
    ledger.add_collective("quorum and commit vote", (ACROSS_JOBS,), 0, overlapped=False, calls=2 / every)
    ledger.add_collective("the groups' options compared", (ACROSS_JOBS,),
                          2 * 8 * len(PARTS) * groups * (groups - 1) / groups / every, overlapped=False,
                          calls=1 / every)
    if sync:
        ledger.add_memory("buffers", lambda rank: min(kept_bytes(rank), BUCKET_BYTES), "gradient bucket", when="end")
    elif plugin_config.mode == "diloco":
        ledger.add_memory("optimizer", lambda rank: 4 * rank.kept_params, "outer momentum", when="held")
