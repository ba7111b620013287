"""Every pair of plugin option values, for each model family: train each stack or see it refused.

    python bench/stack_matrix.py                 # the whole covering array (about an hour on 2 cores)
    python bench/stack_matrix.py --limit 6       # its first stacks
    python bench/stack_matrix.py --start 8       # all but the first 8 (to continue a stopped run)

A covering array (allpairspy) over the first-party plugins' behaviour-changing options and the installed
model families puts every pair of values in some stack, with at most 8 ranks per stack. Each stack is
first planned (``launch.dry_run``): a one-line refusal before launch is a verdict of its own. Otherwise it
trains the tiny job and is compared with the same model in one process: losses within 1e-5 (float8 2e-3)
or it fails, and a crash after launch fails. One line per stack: stack, world size, verdict, max loss
diff, seconds; then the counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
import tempfile
import time
from pathlib import Path

from allpairspy import AllPairs

from titan_core.testing import TINY, compare, run_job

RESUME_STEP = 3
# Each factor: its values as (label, ranks it adds, overrides). "-" leaves the plugin out.
FACTORS = {
    "model": [("llama3", 1, ("model=tiny",)), ("gpt-oss", 1, ("model=gpt_oss_tiny",)), ("qwen3", 1, ("model=qwen3_tiny",)),
              ("qwen3-moe", 1, ("model=qwen3_moe_tiny",)), ("deepseek-v3", 1, ("model=deepseek_v3_tiny",))],
    # Changes the model's function, so the single-process reference takes it too (see reference_overrides).
    "mask": [("-", 1, ()), ("block-causal", 1, ("training.attention_mask=block_causal",))],
    "dp": [("-", 1, ()), ("fsdp", 2, ("fsdp", "plugins.fsdp.degree=2")),
           ("fsdp-reshard-always", 2, ("fsdp", "plugins.fsdp.degree=2", "plugins.fsdp.reshard_after_forward=always")),
           ("hsdp", 4, ("fsdp", "plugins.fsdp.degree=2", "plugins.fsdp.replicate_degree=2")),
           ("simplefsdp", 2, ("simplefsdp", "plugins.simplefsdp.degree=2"))],
    "tp": [("-", 1, ()), ("tp-sp-lp", 2, ("tp", "plugins.tp.degree=2")),
           ("tp-no-sp", 2, ("tp", "plugins.tp.degree=2", "plugins.tp.sequence_parallel=false")),
           ("tp-no-lp", 2, ("tp", "plugins.tp.degree=2", "plugins.tp.loss_parallel=false"))],
    # Borrows its ranks from dp_shard x cp x tp: adds none.
    "ep": [("-", 1, ()), ("ep", 1, ("ep", "plugins.ep.degree=2"))],
    "cp": [("-", 1, ()), ("cp-allgather", 2, ("cp", "plugins.cp.degree=2", "plugins.cp.rotate_method=allgather")),
           ("cp-alltoall", 2, ("cp", "plugins.cp.degree=2", "plugins.cp.rotate_method=alltoall"))],
    "pp": [("-", 1, ())] + [(f"pp-{s}", 2, ("pp", "plugins.pp.degree=2", f"plugins.pp.schedule={s}"))
                            for s in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                      "ZBVZeroBubble", "DualPipeV")],
    "ac": [("-", 1, ()), ("ac-full", 1, ("ac", "plugins.ac.mode=full")),
           ("ac-selective-op", 1, ("ac", "plugins.ac.mode=selective_op")),
           ("ac-selective-layer", 1, ("ac", "plugins.ac.mode=selective_layer"))],
    "compile": [("-", 1, ()), ("compile", 1, ("compile",))],
    "loss": [("-", 1, ()), ("chunked-loss", 1, ("chunked_loss", "plugins.chunked_loss.chunk_tokens=40"))],
    # Saves after step 3, then the same stack resumes there: its last steps must continue the reference.
    "checkpoint": [("-", 1, ()), ("save-resume", 1, ("checkpoint", f"plugins.checkpoint.interval={RESUME_STEP}"))],
    "float8": [("-", 1, ()), ("float8-tensorwise", 1, ("float8", "plugins.float8.recipe=tensorwise")),
               ("float8-rowwise", 1, ("float8", "plugins.float8.recipe=rowwise"))],
    # Changes the training, so the reference takes it too; its float32 Newton-Schulz keeps the 1e-5 comparison.
    "optimizer": [("-", 1, ()), ("muon", 1, ("muon", "plugins.muon.ns_dtype=float32"))],
}
MAX_RANKS = 8
MODELS_WITH_EXPERTS = {"qwen3-moe", "deepseek-v3", "gpt-oss"}
MODELS_WITHOUT_EXPERTS = {label for label, _, _ in FACTORS["model"]} - MODELS_WITH_EXPERTS
LOSS_TOL, FLOAT8_LOSS_TOL = 1e-5, 1e-2


def world(row) -> int:
    return math.prod(ranks for _, ranks, _ in row)


def feasible(values) -> bool:
    """Whether a (partial) stack fits the rank budget and pairs expert parallel only with a model that has
    experts (elsewhere its refusal is certain, and a row refused for it would test nothing else)."""
    labels = {label for label, _, _ in values}
    return world(values) <= MAX_RANKS and not ("ep" in labels and labels & MODELS_WITHOUT_EXPERTS)


def stacks(limit: int | None = None) -> list[tuple]:
    """The covering array's rows, each a tuple of one value per factor.

    allpairspy builds it; under the constraints (:func:`feasible`) its greedy pass leaves many feasible pairs
    out, so further rows are added greedily until every feasible pair is in one.
    """
    factors = list(FACTORS.values())
    rows = [tuple(row) for row in AllPairs(factors, filter_func=feasible)]
    missing = uncovered_pairs(rows)
    while missing:
        row = [None] * len(factors)
        (i, a), (j, b) = min(missing)  # sets iterate in a per-process hash order: sort for one array
        row[i], row[j] = a, b
        for k, values in enumerate(factors):
            if row[k] is None:
                fitting = [v for v in values if feasible([x for x in row if x is not None] + [v])]
                # max keeps the first of equals, in the factor's order: one array every time
                row[k] = max(fitting, key=lambda v: sum(((k, v), (m, x)) in missing or ((m, x), (k, v)) in missing
                                                        for m, x in enumerate(row) if x is not None))
        rows.append(tuple(row))
        missing = uncovered_pairs(rows)
    return rows[:limit]


def uncovered_pairs(rows) -> set:
    """Pairs ((factor, value), (factor, value)) that are feasible together and no row holds."""
    factors = list(FACTORS.values())
    covered = {((i, row[i]), (j, row[j])) for row in rows for i, j in itertools.combinations(range(len(row)), 2)}
    return {((i, a), (j, b)) for i, j in itertools.combinations(range(len(factors)), 2)
            for a in factors[i] for b in factors[j] if feasible([a, b]) and ((i, a), (j, b)) not in covered}


def overrides(row) -> list[str]:
    plugins = [o[0] for _, _, o in row if o and "=" not in o[0]]
    options = [x for _, _, o in row for x in o if "=" in x]
    return [*(["+plugins=[" + ",".join(plugins) + "]"] if plugins else []), *options]


def reference_overrides(row) -> tuple[str, ...]:
    """What the single-process run shares with the stack: the model, its attention mask and the optimizer."""
    shared = [list(FACTORS).index(name) for name in ("model", "mask", "optimizer")]
    return tuple(overrides([row[i] for i in shared]))


def run_stack(row, workdir: Path, reference) -> tuple[str, float | None]:
    """(verdict, max loss diff) of one stack: passed, failed or refused with its line.

    ``reference(overrides)`` gives the single-process run of :func:`reference_overrides` (the parity harness's
    ``titan_reference`` fixture, or a cache here)."""
    args = [*TINY, *overrides(row)]
    planned = run_job([*args, "launch.dry_run=true"], workdir / "plan", expect_success=False)
    if planned.returncode == 2:
        refusal = [line for line in planned.stderr.splitlines() if line.startswith("titan-core: error: ")]
        return ("refused: " + refusal[-1][len("titan-core: error: "):] if refusal else "failed: no one-line refusal",
                None)
    result = run_job(args, workdir / "run", expect_success=False)
    expected = reference(reference_overrides(row))
    if result.returncode == 0 and any(label == "save-resume" for label, _, _ in row):
        saved = workdir / "run" / "checkpoints" / f"step-{RESUME_STEP}"
        result = run_job([*args, f"plugins.checkpoint.load_path={saved}"], workdir / "resumed", expect_success=False)
        expected = dataclasses.replace(expected, after_step=RESUME_STEP)
    if result.returncode != 0:
        return f"failed: exit {result.returncode} after launch", None
    report = compare(result, expected)
    tolerance = FLOAT8_LOSS_TOL if any(label.startswith("float8") for label, _, _ in row) else LOSS_TOL
    return ("passed" if report.max_loss_diff <= tolerance else "failed: losses differ"), report.max_loss_diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, help="run only the first N stacks")
    parser.add_argument("--start", type=int, default=0, help="skip the first N stacks (continue a stopped run)")
    args = parser.parse_args()
    rows, references, counts = stacks(args.limit)[args.start:], {}, {"passed": 0, "refused": 0, "failed": 0}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        def reference(shared: tuple) -> object:
            if shared not in references:
                references[shared] = run_job([*TINY, *shared], Path(tmp) / f"reference-{len(references)}")
            return references[shared]
        for i, row in enumerate(rows):
            began = time.perf_counter()
            verdict, diff = run_stack(row, Path(tmp) / str(i), reference)
            counts[verdict.split(":")[0]] += 1
            label = " ".join(label for label, _, _ in row if label != "-")
            print(f"{label:<70} world {world(row):>2}  {verdict:<40.200}  "
                  f"{'-' if diff is None else f'{diff:.1e}':>8}  {time.perf_counter() - began:6.1f} s", flush=True)
    print(f"{len(rows)} stacks: {counts['passed']} passed, {counts['refused']} refused, {counts['failed']} failed "
          f"in {time.perf_counter() - start:.0f} s")
    sys.exit(1 if counts["failed"] else 0)


if __name__ == "__main__":
    main()
