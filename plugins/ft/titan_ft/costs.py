"""ft's pricing: the gradients' all-reduce across replica groups every step (sync), or the weights' every
``sync_every`` steps (local_sgd, diloco), over the network between the groups; the quorum's messages."""

import math

from titan_core import hookimpl
from titan_core.planner import ACROSS_JOBS
from titan_ft.agreement import PARTS
from titan_ft.plugin import BUCKET_BYTES


@hookimpl
def estimate_costs(estimate, plugin_config, plan):
    """ft: a ring all-reduce of what this rank keeps of the gradients (sync) or of the weights, once per sync
    (local_sgd, diloco), between the same rank of every group; DiLoCo's outer momentum. The quorum (overlapped with
    forward) and the commit vote cost a round trip each: torchft's messages, one answer listing every group; the
    groups' table of option digests, one all-reduce per quorum. DiLoCo's
    copy of the weights as last synchronized lives in host memory, not the device's."""
    groups, sync = plan.replica_group[1], plugin_config.mode == "sync"
    every = 1 if sync else plugin_config.sync_every

    def kept_bytes(e):  # float32 gradients or weights this rank keeps after every split
        return 4 * e.sharded_params() * (e.trained_share if sync else 1)

    estimate.add_collective(f"{'gradients' if sync else 'weights'} averaged across {groups} replica groups",
                            (ACROSS_JOBS,), lambda e: 2 * kept_bytes(e) * (groups - 1) / groups / every,
                            overlapped=False, plugin="ft",
                            # torchft's LocalSGD and DiLoCo all-reduce each parameter on its own
                            calls=lambda e: (math.ceil(kept_bytes(e) / BUCKET_BYTES) if sync
                                             else e.facts.parameter_tensors) / every)
    estimate.add_collective("quorum and commit vote", (ACROSS_JOBS,), 0, overlapped=False, plugin="ft",
                            calls=2 / every)
    estimate.add_collective("the groups' options compared", (ACROSS_JOBS,),
                            2 * 8 * len(PARTS) * groups * (groups - 1) / groups / every, overlapped=False, plugin="ft",
                            calls=1 / every)
    if sync:
        estimate.add_memory("buffers", lambda e: min(kept_bytes(e), BUCKET_BYTES), "gradient bucket", "ft", when="end")
    elif plugin_config.mode == "diloco":
        estimate.add_memory("optimizer", lambda e: 4 * e.sharded_params(), "outer momentum", "ft", when="held")
