"""The model and plugin contract, tried the way an outsider would: a model plugin and plugins written from
docs/writing-models.md and docs/writing-plugins.md, installed for the test."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_core.errors import ConfigError
from titan_core.planner.costs import estimate
from titan_core.planner.hardware import hardware_profile
from titan_core.plugins import Hooks, Registry, build_plan
from titan_core.testing import LOSS_TOL, PARAM_TOL, TINY, compare, compose, error_line, install_plugins, run_job

# A model the core has never seen: its own names, learned positions computed inside forward, and a
# description that says only what it must. Plugins that need more must refuse it, never train it wrong.
BARE_MODEL = """
import functools

import torch
import torch.nn.functional as F
from torch import nn

from titan_core import hookimpl
from titan_core.attention import causal_attention
from titan_core.description import CORE_ATTENTION, ExpertsLayout, ModelDescription, ParamInit
from titan_core.objective import add_loss


class Experts(nn.Module):  # every expert of a block; the copies come sorted by expert, counts of each

    def __init__(self, experts, dim):
        super().__init__()
        self.up = nn.Parameter(torch.empty(experts, 2 * dim, dim))
        self.down = nn.Parameter(torch.empty(experts, dim, 2 * dim))

    def forward(self, tokens, counts):
        outs = [F.gelu(chunk @ self.up[e].T) @ self.down[e].T
                for e, chunk in enumerate(torch.split(tokens, counts.tolist()))]
        return torch.cat(outs)


class TopTwo(nn.Module):
    def __init__(self, experts, dim, z_loss):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(experts, dim)
        self.z_loss = z_loss

    def forward(self, x):
        flat = x.flatten(0, 1)
        logits = self.router(flat)
        weights, chosen = logits.softmax(-1).topk(2, dim=-1)
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.router.out_features)
        token = order // 2
        out = self.experts(flat[token], counts) * weights.flatten()[order, None]
        out = torch.zeros_like(flat).index_add(0, token, out).view_as(x)
        if not self.z_loss:
            return out
        return add_loss(out, self.z_loss * logits.logsumexp(-1).square().mean())  # the router's z-loss


class EvenExperts(Experts):  # as many copies for every expert: no count is read, so the planner can trace it

    def forward(self, tokens, counts):
        batch = tokens.unflatten(0, (len(counts), -1))
        return (F.gelu(batch @ self.up.mT) @ self.down.mT).flatten(0, 1)


class ExpertChoice(nn.Module):  # each expert takes the quarter of the tokens it scores best
    def __init__(self, experts, dim):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = EvenExperts(experts, dim)

    def forward(self, x):
        flat = x.flatten(0, 1)
        weights, token = self.router(flat).softmax(-1).T.topk(len(flat) // 4, dim=-1)
        counts = torch.full((len(weights),), token.shape[1], device=x.device)
        out = self.experts(flat[token.flatten()], counts) * weights.flatten()[:, None]
        return torch.zeros_like(flat).index_add(0, token.flatten(), out).view_as(x)


class Block(nn.Module):
    def __init__(self, dim, experts, z_loss, routing):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        chosen = ExpertChoice if routing == "expert_choice" else functools.partial(TopTwo, z_loss=z_loss)
        self.moe = chosen(experts, dim) if experts else None

    def forward(self, x, document_ids=None):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        x = x + self.out(causal_attention(q, k, v, document_ids).transpose(1, 2).flatten(2))
        return x if self.moe is None else x + self.moe(x)


class Bare(nn.Module):
    def __init__(self, vocab, dim, layers, seq, experts, z_loss, routing):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.stack = nn.ModuleDict({str(i): Block(dim, experts, z_loss, routing) for i in range(layers)})
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, document_ids=None):
        h = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.stack.values():
            h = block(h, document_ids)
        return self.head(h)


@hookimpl
def describe_model(model_config, vocab_size, seq_len):
    experts = model_config.get("experts", 0)
    return ModelDescription(family="bare", args=(vocab_size, model_config.dim, model_config.layers, seq_len, experts,
                                                 model_config.z_loss, model_config.routing),
                            n_layers=model_config.layers, blocks="stack", attention=CORE_ATTENTION,
                            experts=ExpertsLayout(module="moe.experts", count=experts, linears=("up", "down"))
                            if experts else None,
                            param_init=lambda name: ParamInit.constant(0.0) if name.endswith("bias")
                            else ParamInit.normal(0.02),
                            flops_per_token=lambda seq: 6.0 * seq)


@hookimpl
def build_model(description):
    return Bare(*description.args)
"""

# A plugin without declare that uses the lifecycle hooks: it replaces the LR schedule by a constant,
# checks the weights exist after init, sees the optimizer after each step and reads its own options.
PROBE = """
import json
import os
import torch
from titan_core import hookimpl

seen = {"after_init": None, "optimizer_steps": 0}


@hookimpl
def build_lr_scheduler(optimizer, plugin_config):
    for group in optimizer.param_groups:
        group["lr"] = plugin_config.lr
    return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)


@hookimpl
def after_init(model_parts):
    seen["after_init"] = all(not p.is_meta for part in model_parts for p in part.parameters())


@hookimpl
def after_optimizer_step(optimizer, step):
    seen["optimizer_steps"] += bool(optimizer.state)


@hookimpl
def step_metrics(step):
    return {"probe_step_squared": float(step * step)}


@hookimpl
def on_train_end(plugin_config):
    with open(plugin_config.out, "w") as f:
        json.dump(seen, f)
"""

TYPO = """
from titan_core import hookimpl


@hookimpl
def apply_paralelism(model_parts):
    pass
"""


@pytest.fixture
def outsiders(tmp_path):
    return install_plugins(tmp_path / "site", {"probe": (PROBE, "lr: 5.0e-4\nout: null\n"), "typo": (TYPO, "")},
                           distribution="outsider", models={"bare": (BARE_MODEL, {"bare_tiny": "name: bare\ndim: 32\n"
                                                                                               "layers: 2\nexperts: 0\n"
                                                                                               "z_loss: 0.0\n"
                                                                                               "routing: top_two\n"})})


BARE = [*TINY, "model=bare_tiny"]
TRACKED_RANK = Path(__file__).with_name("tracked_rank.py")


@pytest.mark.slow
def test_an_outside_mixture_of_experts_trains_expert_parallel_like_one_process(tmp_path, outsiders):
    """The experts contract of docs/writing-models.md: a module of all experts called with the copies sorted
    by expert. Under ep each rank's module holds 2 of the 4 experts and sees counts of length 2. The router
    adds a z-loss through titan_core.objective.add_loss: under two accumulated micro-batches its gradient
    must count once, as in the single pass of the reference (weighted 1 instead of 1/2, the weights end
    7e-3 apart)."""
    moe = [*BARE, "model.experts=4", "model.z_loss=1.0"]
    reference = run_job(moe, tmp_path / "one", env=outsiders)
    result = run_job([*moe, "+plugins=[fsdp,ep]", "plugins.fsdp.degree=2", "plugins.ep.degree=2",
                      "training.grad_accum_steps=2"], tmp_path / "ep", env=outsiders)
    assert "holds experts 2-3 of 4 in each of 2 blocks" in (result.run_dir / "logs" / "rank1.log").read_text()
    report = compare(result, reference)
    assert report.max_loss_diff <= 1e-5 and report.max_param_diff <= 1e-4, report


@pytest.mark.slow
def test_an_outside_models_own_experts_are_planned_from_what_they_keep(tmp_path, outsiders, monkeypatch):
    """docs/writing-models.md's experts contract as the planner reads it: a model's own experts module whose call
    reads no value (expert choice: each of 4 experts takes its best quarter of the tokens) is traced on the meta
    device, the copies entering it and what it keeps counted as its experts' (one copy a token, what
    --expert-load would grow), and the plan is within 5% of torch's tracker over a real step. The top-two
    router, which counts its copies on the host, is refused in one line."""
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    job = [*BARE, "model.experts=4", "model.routing=expert_choice"]
    config = compose(*job)
    registry = Registry(config)
    result = estimate(config, build_plan(config, registry, None, 256), registry, hardware_profile("cpu-measured"))
    facts = result.facts
    assert facts.block_expert_copies == pytest.approx((1.0, 1.0))
    assert all(0 < experts < kept for experts, kept in zip(facts.block_expert_saved, facts.block_saved))
    assert dataclasses.replace(result, expert_load=2.0).memory()["activations"] > result.memory()["activations"]
    tracked = subprocess.run([sys.executable, str(TRACKED_RANK), "1", str(tmp_path / "tracked"), *job],
                             env=outsiders, capture_output=True, text=True, timeout=300)
    assert tracked.returncode == 0, tracked.stderr[-3000:]
    measured = json.loads((tmp_path / "tracked" / "rank0.json").read_text())
    error = sum(result.memory().values()) / measured["Total"] - 1
    print(f"planned {error:+.1%} of the tracker's peak")
    assert abs(error) < 0.05

    config = compose(*BARE, "model.experts=4")
    registry = Registry(config)
    with pytest.raises(ConfigError, match="model 'bare' cannot run on the meta device, which the planner traces"):
        estimate(config, build_plan(config, registry, None, 256), registry, hardware_profile("cpu-measured")).facts


@pytest.mark.slow
def test_lora_adapts_an_outside_models_experts_named_in_its_description(tmp_path, outsiders):
    """``ExpertsLayout.linears`` names the experts' stacked linears (docs/writing-models.md): lora gives each
    expert its own pair on each, which trains (B leaves zero) and is split by expert under ep like the weights,
    as one process trains it."""
    lora = [*BARE, "model.experts=4", "plugins.lora.targets=[experts]", "plugins.lora.rank=2",
            "plugins.lora.export=none"]
    reference = run_job([*lora, "+plugins=[lora]"], tmp_path / "one", env=outsiders)
    result = run_job([*lora, "+plugins=[fsdp,ep,lora]", "plugins.fsdp.degree=2", "plugins.ep.degree=2"],
                     tmp_path / "ep", env=outsiders)
    report = compare(result, reference)
    assert report.max_loss_diff <= 1e-5 and report.max_param_diff <= 1e-4, report
    b = reference.final_weights()["stack.0.moe.experts.up_lora_B"]
    assert b.shape == (4, 64, 2) and b.abs().min(-1).values.min() > 0  # every expert's B trained


@pytest.mark.slow
def test_an_outside_model_masks_documents_sharded_like_one_process(tmp_path, outsiders):
    """The outside model sharded (fsdp x ac) trains like one process, here through the attention seam of
    docs/writing-models.md: documents of 2 to 9 bytes, masked from each other."""
    data = tmp_path / "documents.jsonl"
    data.write_text("".join(json.dumps({"text": "ab cd efg"[:2 + i % 8]}) + "\n" for i in range(500)))
    # lr 1e-2: the tiny model's attention moves away from uniform within the 5 steps, so the mask shows.
    masked = [*BARE, "optimizer.lr=1e-2", "data.source=local", f"data.path={data}",
              "training.attention_mask=block_causal"]
    reference = run_job(masked, tmp_path / "one", env=outsiders)
    causal = run_job(masked[:-1], tmp_path / "causal", env=outsiders)
    # The mask is applied: 4.7e-3 measured, far above the 1e-5 a sharded run ignoring it would have to meet.
    assert max(abs(a - b) for a, b in zip(reference.losses, causal.losses)) > 1e-3
    report = compare(run_job([*masked, "+plugins=[fsdp,ac]", "plugins.fsdp.degree=2"], tmp_path / "fsdp",
                             env=outsiders), reference)
    assert report.max_loss_diff <= 1e-5 and report.max_param_diff <= 1e-4, report


@pytest.mark.parametrize("plugin, lacking, what", [
    ("cp", "position_buffers", "context parallel"),
    ("pp", "inputs", "pipeline parallel"),
    ("tp", "tensor_parallel", "tensor parallel"),
])
def test_plugins_refuse_what_the_model_does_not_describe(tmp_path, outsiders, plugin, lacking, what):
    result = run_job([*BARE, "launch.dry_run=true", f"+plugins=[{plugin}]"], tmp_path, expect_success=False,
                     env=outsiders)
    assert f"model 'bare' does not describe {lacking}, which {what}" in error_line(result)


def test_model_options_are_the_models_own(tmp_path, outsiders):
    result = run_job([*TINY, "launch.dry_run=true", "+model.n_positions=64"], tmp_path / "llama", expect_success=False)
    assert "model.n_positions: is not a Llama 3 option" in error_line(result)
    result = run_job([*BARE, "launch.dry_run=true", "model.name=nosuch"], tmp_path / "name", expect_success=False,
                     env=outsiders)
    assert "model.name: no installed model plugin is named 'nosuch' (installed: bare," in error_line(result)


def test_a_misspelled_hook_is_refused_at_start(tmp_path, outsiders):
    result = run_job([*TINY, "launch.dry_run=true", "+plugins=[typo]"], tmp_path, expect_success=False, env=outsiders)
    line = error_line(result)
    assert "plugins.typo:" in line and "apply_paralelism" in line


def test_lifecycle_hooks_and_own_options(tmp_path, outsiders):
    out = tmp_path / "seen.json"
    result = run_job([*TINY, "training.steps=3", "+plugins=[probe]", f"plugins.probe.out={out}"], tmp_path / "run",
                     env=outsiders)
    assert [m["lr"] for m in result.metrics] == [5e-4] * 3  # the lr the optimizer used, set by the plugin
    assert [m["probe_step_squared"] for m in result.metrics] == [1, 4, 9]  # its own metric, logged every step
    assert "| probe_step_squared 9 |" in result.stdout
    assert json.loads(out.read_text()) == {"after_init": True, "optimizer_steps": 3}
    assert "   -  probe" in result.stdout  # no declare: no stage, still in the plan


# A plugin written from docs/writing-plugins.md alone, using every event the contract gained: a class (one object
# per run) with state a checkpoint keeps, a data-parallel dimension of its own whose gradients it averages in
# after_backward, a module conversion, the micro-batch index and count, and the error event.
REPLICA = """
import json
import os
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titan_core import PP, Declaration, MeshDimension, hookimpl, replace


class CountingLinear(nn.Linear):
    \"\"\"A linear that counts its forwards: the same arithmetic as the one it replaces.\"\"\"

    forwards = 0

    def forward(self, x):
        self.forwards += 1
        return super().forward(x)


class Replica:
    def __init__(self):
        self.steps_done = 0           # kept by checkpoints
        self.micro_batches = []
        self.averaged = 0
        self.tracked = None           # rank 0's, as a tracker's run: what it was started with, the losses sent

    @hookimpl
    def declare(self, plugin_config):
        \"\"\"replica: a data-parallel dimension of its own, sized by `size`.\"\"\"
        return Declaration(mesh={"replica": plugin_config.size}, options={"replica": "size"},
                           dimensions={"replica": MeshDimension(after=PP, data_parallel=True)})

    @hookimpl
    def convert_modules(self, model, plan):
        \"\"\"replica: every linear of every block counts its forwards.\"\"\"
        for block in plan.model.blocks_of(model).values():
            for name, module in list(block.named_modules()):
                if type(module) is nn.Linear:
                    replace(block, name, CountingLinear(module.in_features, module.out_features,
                                                        bias=module.bias is not None, device="meta"))

    @hookimpl
    def batch_context(self, micro_batch, micro_batches):
        \"\"\"replica: record which micro-batch of how many runs.\"\"\"
        self.micro_batches.append([micro_batch, micro_batches])

    @hookimpl
    def after_backward(self, model_parts, mesh):
        \"\"\"replica: average the step's gradients over the replica ranks.\"\"\"
        group = mesh.submesh("replica").get_group()
        for part in model_parts:
            for param in part.parameters():
                if param.grad is not None:
                    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=group)
        self.averaged += 1

    @hookimpl
    def after_optimizer_step(self, step, plugin_config):
        \"\"\"replica: fail where the test asks.\"\"\"
        if step == plugin_config.fail_at:
            raise RuntimeError(f"injected at step {step}")

    @hookimpl
    def step_metrics(self, model_parts):
        \"\"\"replica: steps done so far (restored on resume) and the counting linears' forwards.\"\"\"
        calls = sum(m.forwards for part in model_parts for m in part.modules() if isinstance(m, CountingLinear))
        return {"replica_steps_done": self.steps_done + 1, "linear_forwards": calls}

    @hookimpl
    def start_tracking(self, run, first_step):
        \"\"\"replica: start a record of the run, as a tracker would.\"\"\"
        self.tracked = {"first_step": first_step, "world": run["world"]["size"], "losses": {}}

    @hookimpl
    def on_step_end(self, step, metrics):
        \"\"\"replica: count the step; send a logged step's loss to the record.\"\"\"
        self.steps_done += 1
        if self.tracked is not None and metrics:
            self.tracked["losses"][step] = metrics["loss"]

    def state_dict(self):
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state):
        self.steps_done = state["steps_done"]

    def _report(self, plugin_config, **extra):
        report = {"micro_batches": self.micro_batches, "averaged": self.averaged, "tracked": self.tracked, **extra}
        Path(plugin_config.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))

    @hookimpl
    def on_train_end(self, state, preempted, plugin_config):
        \"\"\"replica: write what it saw.\"\"\"
        counting = sum(isinstance(m, CountingLinear) for part in state.model_parts for m in part.modules())
        self._report(plugin_config, counting_linears=counting, preempted=preempted)

    @hookimpl
    def on_error(self, error, step, plugin_config):
        \"\"\"replica: write what failed, and when.\"\"\"
        self._report(plugin_config, error=f"{type(error).__name__}: {error}", step=step)
"""


@pytest.fixture
def replica(tmp_path):
    return install_plugins(tmp_path / "site", {"replica": (REPLICA, "size: 1\nfail_at: 0\nout: .\n")},
                           distribution="replica-plugin", plugin_objects={"replica": "Replica"})


def _reports(out, ranks):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.slow
def test_an_outsiders_data_parallel_dimension_averages_in_the_gradient_event_under_pp(tmp_path, replica):
    """replica 2 x pp 2 with two accumulated micro-batches trains like one process: the outsider's plugin averages
    the gradients over its dimension once per step, after every stage's backward. Without that average the two
    replicas' weights would part (final_weights refuses ranks that disagree)."""
    out = tmp_path / "out"
    out.mkdir()
    accumulated = [*TINY, "training.grad_accum_steps=2"]
    reference = run_job(accumulated, tmp_path / "one")
    result = run_job([*accumulated, "+plugins=[pp,replica]", "plugins.pp.degree=2", "plugins.replica.size=2",
                      f"plugins.replica.out={out}"], tmp_path / "run", env=replica)
    assert "world 4 = pp 2 x replica 2" in result.stdout
    report = compare(result, reference)
    assert report.max_loss_diff <= 1e-5 and report.max_param_diff <= 1e-4, report
    for seen in _reports(out, 4):
        assert seen["averaged"] == 5  # once per step
        assert seen["micro_batches"] == [[0, 2], [1, 2]] * 5
        assert seen["counting_linears"] == 2 * 7  # two blocks a stage, seven linears a block: all converted
    assert result.metrics[-1]["linear_forwards"] > 0
    tracked = [seen["tracked"] for seen in _reports(out, 4)]
    assert tracked[1:] == [None, None, None]  # rank 0 only
    assert tracked[0] == {"first_step": 1, "world": 4, "losses": {str(m["step"]): m["loss"] for m in result.metrics}}


@pytest.mark.slow
def test_an_outsiders_state_is_checkpointed_and_restored(tmp_path, replica):
    """The plugin object's state (steps done) is saved with the training state and restored on resume: the resumed
    run logs what the uninterrupted one did, its own counter included."""
    job = [*TINY, "+plugins=[replica,checkpoint]", "plugins.checkpoint.interval=2", f"plugins.replica.out={tmp_path}"]
    whole = run_job(job, tmp_path / "whole", env=replica)
    saved = tmp_path / "whole" / "checkpoints" / "step-2"
    resumed = run_job([*job, f"plugins.checkpoint.load_path={saved}"], tmp_path / "resumed", env=replica)
    assert [m["step"] for m in resumed.metrics] == [3, 4, 5]
    assert [m["replica_steps_done"] for m in resumed.metrics] == [3, 4, 5]
    for key in ("loss", "grad_norm", "replica_steps_done"):
        assert [m[key] for m in resumed.metrics] == [m[key] for m in whole.metrics[2:]], key
    (seen,) = _reports(tmp_path, 1)  # the resumed run's: its record starts at step 3
    losses = {str(m["step"]): m["loss"] for m in resumed.metrics}
    assert seen["tracked"] == {"first_step": 3, "world": 1, "losses": losses}


def test_a_failing_run_tells_the_plugins_before_its_one_line(tmp_path, replica):
    result = run_job([*TINY, "training.steps=3", "+plugins=[replica]", "plugins.replica.fail_at=2",
                      f"plugins.replica.out={tmp_path}"], tmp_path / "run", expect_success=False, env=replica)
    assert result.returncode == 1
    assert [line for line in result.stderr.splitlines() if line.startswith("titan-core:")] == [
        f"titan-core: rank 0 failed: RuntimeError: injected at step 2; traceback in {tmp_path / 'run' / 'logs'}"
        "/rank0.log"]
    (seen,) = _reports(tmp_path, 1)
    assert (seen["error"], seen["step"]) == ("RuntimeError: injected at step 2", 2)


SLOW_TO_REPORT = """
import time
from pathlib import Path

import torch.distributed as dist
from titan_core import hookimpl


@hookimpl
def on_step_end(step):
    \"\"\"slow: rank 1 fails after step 2.\"\"\"
    if step == 2 and dist.get_rank() == 1:
        raise RuntimeError("injected after step 2")


@hookimpl
def on_error(error, plugin_config):
    \"\"\"slow: rank 0 writes what reached it, after a while (as a tracker's server would answer).\"\"\"
    if dist.get_rank() == 0:
        time.sleep(plugin_config.seconds)
        Path(plugin_config.out, "rank0.txt").write_text(str(error))
"""


def test_a_peers_failure_lets_this_ranks_plugins_finish_their_answers(tmp_path):
    """Rank 1 fails and exits; the elastic agent then sends SIGTERM to rank 0, still in its on_error. The answer is
    finished (before, a tracker's run record was cut mid-write: MLflow could no longer read that run)."""
    env = install_plugins(tmp_path / "site", {"slow": (SLOW_TO_REPORT, f"seconds: 2\nout: {tmp_path}\n")})
    result = run_job([*TINY, "training.steps=3", "+plugins=[slow,fsdp]", "plugins.fsdp.degree=2"], tmp_path / "run",
                     env=env, expect_success=False)
    assert result.returncode == 1 and "rank 1 failed: RuntimeError: injected after step 2" in result.stderr
    assert (tmp_path / "rank0.txt").read_text() == "rank 1: RuntimeError: injected after step 2"


ORDERED = """
from titan_core import hookimpl


@hookimpl({option}=True)
def apply_parallelism(model_parts):
    {body}
"""


@pytest.mark.parametrize("option", ["wrapper", "hookwrapper", "tryfirst", "trylast"])
def test_pluggy_options_the_core_cannot_honour_are_refused(tmp_path, option):
    """A wrapper would get no implementation to wrap and tryfirst/trylast nothing to order: each plugin's hook is
    called on its own. Before this check a wrapper registered, passed, and its body never ran."""
    source = ORDERED.format(option=option, body="return (yield)" if option.endswith("wrapper") else "return None")
    env = install_plugins(tmp_path / "site", {"wrapping": (source, "")}, "wrapping-plugin")
    result = run_job([*TINY, "launch.dry_run=true", "+plugins=[wrapping]"], tmp_path / "run", expect_success=False,
                     env=env)
    assert (f"titan-core: error: plugins.wrapping: its apply_parallelism is marked {option}=True, which titan-core "
            "cannot honour") in error_line(result)


def test_each_plugins_hooks_are_called_through_pluggy():
    """Calls go through pluggy's hook callers (its call monitoring sees them), one plugin at a time, in plan order."""
    config = compose(*TINY, "+plugins=[fsdp,ac,tp]", "plugins.fsdp.degree=1", "plugins.tp.degree=1")
    registry = Registry(config)
    seen = []
    registry.pm.add_hookcall_monitoring(lambda name, impls, kwargs: seen.append((name, [i.plugin_name for i in impls])),
                                        lambda outcome, name, impls, kwargs: None)
    plan = build_plan(config, registry, None, 256, validate=False)
    Hooks(registry, plan, config).each("validate", config=config)
    assert [impls for name, impls in seen if name == "validate"] == [["tp"], ["ac"], ["fsdp"]]
    assert ("declare", ["fsdp"]) in seen and ("describe_model", ["llama3"]) in seen


VALIDATION_ROWS = """
from titan_core import hookimpl


@hookimpl
def build_validation_batches(config, tokenizer, dp_rank, dp_size):
    return []
"""
PRICED_IN_PLUGIN = """
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate):
    pass
"""


def test_every_builder_hook_needs_one_answer(tmp_path, monkeypatch):
    """The hooks that need one answer are those the specs mark firstresult, not a hand-written list (which once
    lacked build_validation_batches: two plugins implementing it passed, and the first silently won)."""
    install_plugins(tmp_path / "site", {"rows_a": (VALIDATION_ROWS, ""), "rows_b": (VALIDATION_ROWS, "")},
                    "rows-plugins")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ConfigError, match="each of rows_a, rows_b implements build_validation_batches, which needs "
                                          "one answer"):
        Registry(compose(*TINY, "+plugins=[rows_a,rows_b]"))
    assert Registry(compose(*TINY, "+plugins=[rows_a]")).owner("build_validation_batches") == "rows_a"


def test_pricing_in_a_plugins_own_module_is_refused_in_one_line(tmp_path):
    """The planner's hooks live in a pricing module of their own (titan_core.costs), which training never loads: a
    plugin module implementing estimate_costs is refused before launch, naming where it goes."""
    env = install_plugins(tmp_path / "site", {"priced": (PRICED_IN_PLUGIN, "")}, "priced-plugin")
    line = error_line(run_job([*TINY, "launch.dry_run=true", "+plugins=[priced]"], tmp_path / "run",
                              expect_success=False, env=env))
    assert "plugins.priced: unknown hook 'estimate_costs'" in line
    assert "the planner's hooks go in a pricing module registered under titan_core.costs" in line


def test_a_plugin_that_fails_to_load_is_one_line(tmp_path):
    source = "from titan_core import hookimpl\nraise ImportError('no cuda')\n"
    env = install_plugins(tmp_path / "site", {"broken": (source, "")}, "broken-plugin")
    line = error_line(run_job([*TINY, "launch.dry_run=true", "+plugins=[broken]"], tmp_path / "run",
                              expect_success=False, env=env))
    assert "plugins.broken: plugin 'broken' (broken_plugin_broken) fails to load: ImportError: no cuda" in line
    assert "fix: fix or reinstall broken-plugin" in line


TEXT_ROWS = '''
import torch
from titan_core import hookimpl


class Rows:
    """Every batch the same: a data plugin reduced to what the core asks of one."""

    def __init__(self, rows, seq_len):
        self.tokens = torch.arange(rows * (seq_len + 1)).view(rows, seq_len + 1) % 200

    def __next__(self):
        return self.tokens[:, :-1], self.tokens[:, 1:]

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@hookimpl
def build_dataloader(config, dp_size):
    """rows: the same rows every step."""
    return Rows(config.training.global_batch_size // dp_size, config.training.seq_len)
'''


# A data plugin as docs/writing-plugins.md describes one: labels it does not train on are IGNORE_INDEX, and it
# gives its own held-out batches.
MASKED_ROWS = '''
import torch
from titan_core import IGNORE_INDEX, hookimpl


class Rows:
    """The same rows every step; row r trains on its last 5 r + 3 tokens only."""

    def __init__(self, first_row, rows, seq_len, offset):
        row = torch.arange(first_row, first_row + rows)[:, None]
        tokens = (torch.arange(seq_len + 1) * 7 + row * 13 + offset) % 200
        self.inputs, self.labels = tokens[:, :-1], tokens[:, 1:].clone()
        self.labels[torch.arange(seq_len) < seq_len - (row * 5 + 3)] = IGNORE_INDEX

    def __next__(self):
        return self.inputs, self.labels

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def rows(config, dp_rank, dp_size, offset):
    local = config.training.global_batch_size // dp_size
    return Rows(dp_rank * local, local, config.training.seq_len, offset)


@hookimpl
def build_dataloader(config, dp_rank, dp_size):
    """masked: fixed rows, each trained on a different number of its last tokens."""
    return rows(config, dp_rank, dp_size, 0)


@hookimpl
def build_validation_batches(config, dp_rank, dp_size):
    """masked: other fixed rows, masked alike."""
    return [rows(config, dp_rank, dp_size, 1).__next__() for _ in range(config.validation.batches)]
'''


@pytest.mark.slow
def test_an_outsiders_masked_data_trains_and_validates_under_fsdp_like_one_process(tmp_path):
    """Rows training on 3 to 32 of their 32 tokens: two ranks of four rows, two micro-batches each, train and
    validate as one process does on the eight (a mean per rank or micro-batch would not)."""
    env = install_plugins(tmp_path / "site", {"masked": (MASKED_ROWS, "")}, "masked-plugin")
    validating = ["validation.every=5", "validation.batches=1"]
    one = run_job([*TINY, "+plugins=[masked]", *validating], tmp_path / "one", env=env)
    sharded = run_job([*TINY, "+plugins=[masked,fsdp]", "plugins.fsdp.degree=2", "training.grad_accum_steps=2",
                       *validating], tmp_path / "fsdp", env=env)
    report = compare(sharded, one)
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report
    validation = [[m["validation_loss"] for m in run.metrics if "validation_loss" in m] for run in (one, sharded)]
    assert len(validation[0]) == 1 and validation[0] == pytest.approx(validation[1], abs=LOSS_TOL)


# An outsider's conversion written from docs/writing-plugins.md ("Linears whose gathered tensors travel narrow"): it
# marks every block linear with casts that change nothing and count what tensor parallel hands them; after every
# transform (after_init) it keeps the precision of the linears it is told to, as a later conversion would.
GATHER_WATCH = '''
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from titan_core import GatherCasts, attribute, cast_gathers, hookimpl, keep_precision


def split_along_the_sequence(tensor):
    return isinstance(tensor, DTensor) and tuple(tensor.placements) == (Shard(1),)


class PassGradient(torch.autograd.Function):
    """The output unchanged; in backward, counts the gradients that arrive split along the sequence."""

    @staticmethod
    def forward(ctx, output, seen):
        ctx.seen = seen
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        ctx.seen["grads"] += split_along_the_sequence(grad)
        return grad, None


class Watch:
    def __init__(self):
        self.seen = {"inputs": 0, "grads": 0}

    def count_input(self, stream):
        self.seen["inputs"] += split_along_the_sequence(stream)
        return stream

    @hookimpl
    def convert_modules(self, model, plan):
        """watch: marks every linear of every block."""
        casts = GatherCasts(input=self.count_input, output_grad=lambda output: PassGradient.apply(output, self.seen),
                            same="watch")
        for block in plan.model.blocks_of(model).values():
            for module in block.modules():
                if isinstance(module, nn.Linear):
                    cast_gathers(module, casts)

    @hookimpl
    def after_init(self, model_parts, plugin_config, plan):
        """watch: keeps the precision of the linears named in keep."""
        for part in model_parts:
            for block in plan.model.blocks_of(part).values():
                for path in plugin_config.keep:
                    keep_precision(attribute(block, path))

    @hookimpl
    def step_metrics(self):
        """watch: the casts tensor parallel called since the last logged step."""
        seen, self.seen["inputs"], self.seen["grads"] = dict(self.seen), 0, 0
        return {"inputs_cast": seen["inputs"], "gradients_cast": seen["grads"]}
'''


@pytest.mark.slow
def test_an_outsiders_gather_casts_are_called_once_per_region_and_row_wise_gradient(tmp_path):
    """Tensor parallel hands the outsider's input cast each region's input split along the sequence, once for all
    its readers (the feed-forward's, 4 blocks a step; the attention's never, one of its readers kept its precision
    after tp's stage), and its gradient cast each row-wise output's gradient split along the sequence (2 a block);
    the casts change nothing, so the step is one process's. One process calls neither."""
    env = install_plugins(tmp_path / "site", {"watch": (GATHER_WATCH, "keep: [attention.wk]\n")}, "watch-plugin",
                          plugin_objects={"watch": "Watch"})
    one = run_job([*TINY, "+plugins=[watch]"], tmp_path / "one", env=env)
    split = run_job([*TINY, "+plugins=[watch,tp]", "plugins.tp.degree=2"], tmp_path / "tp", env=env)
    report = compare(split, one)
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report
    blocks = 4
    assert {(m["inputs_cast"], m["gradients_cast"]) for m in split.metrics} == {(blocks, 2 * blocks)}, split.metrics
    assert {(m["inputs_cast"], m["gradients_cast"]) for m in one.metrics} == {(0, 0)}


def test_training_data_from_a_plugin_without_validation_data_is_refused_when_validating(tmp_path):
    """The core's held-out text would validate a model trained on other data: refused before launch, and
    without validation the plugin's batches train."""
    env = install_plugins(tmp_path / "site", {"rows": (TEXT_ROWS, "")}, "rows-plugin")
    refused = run_job([*TINY, "+plugins=[rows]", "validation.every=2"], tmp_path / "refused", expect_success=False,
                      env=env)
    assert error_line(refused) == (
        "titan-core: error: validation.every: the training batches come from plugin 'rows', which gives no validation "
        "batches (build_validation_batches); fix: set validation.every=0, or add build_validation_batches to that "
        "plugin")
    trained = run_job([*TINY, "+plugins=[rows]", "training.steps=3"], tmp_path / "trained", env=env)
    assert trained.losses[2] < trained.losses[0] - 0.1  # the same rows each step: learnt by heart


# A MoE model assembled from the core's building blocks, as docs/writing-models.md says: options deriving
# MoeOptions, the core's MoE in every other block, the plugin object an ExpertRouting (its routing hooks and state).
CORE_MOE_MODEL = """
from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from titan_core import (CORE_ATTENTION, ExpertRouting, ExpertsLayout, ModelDescription, MoE, MoeOptions, ParamInit,
                        SwiGLU, causal_attention, check_moe_options, hookimpl, init_routing_buffers, read_options)


@dataclass
class Options(MoeOptions):
    hidden_size: int = 32
    num_hidden_layers: int = 2
    vocab_size: int = 256

    def sparse(self, layer):
        return layer % 2 == 1


class Block(nn.Module):
    def __init__(self, options, layer):
        super().__init__()
        self.qkv = nn.Linear(options.hidden_size, 3 * options.hidden_size)
        self.mlp = MoE(options) if options.sparse(layer) else SwiGLU(options.hidden_size, 2 * options.hidden_size)

    def forward(self, x, document_ids=None):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        x = x + causal_attention(q, k, v, document_ids).transpose(1, 2).flatten(2)
        return x + self.mlp(F.rms_norm(x, x.shape[-1:]))


class Routed(nn.Module):
    def __init__(self, options):
        super().__init__()
        self.embed = nn.Embedding(options.vocab_size, options.hidden_size)
        self.blocks = nn.ModuleDict({str(i): Block(options, i) for i in range(options.num_hidden_layers)})
        self.head = nn.Linear(options.hidden_size, options.vocab_size)

    def forward(self, tokens, document_ids=None):
        h = self.embed(tokens)
        for block in self.blocks.values():
            h = block(h, document_ids)
        return self.head(h)


class RoutedPlugin(ExpertRouting):
    @hookimpl
    def describe_model(self, model_config, vocab_size, seq_len):
        options = Options(**read_options(model_config, ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                        "score_function", "router_bias_update_rate", "hidden_size",
                                                        "num_hidden_layers", "vocab_size"), "routed", vocab_size))
        check_moe_options(options)
        return ModelDescription(family="routed", args=options, n_layers=options.num_hidden_layers, blocks="blocks",
                                attention=CORE_ATTENTION, init_buffers=init_routing_buffers,
                                experts=ExpertsLayout(module="mlp.experts", count=options.num_experts),
                                param_init=lambda name: ParamInit.normal(0.02), flops_per_token=lambda seq: 6.0 * seq)

    @hookimpl
    def build_model(self, description):
        return Routed(description.args)
"""


@pytest.mark.slow
def test_a_model_built_from_the_cores_moe_blocks_trains_and_balances(tmp_path):
    env = install_plugins(tmp_path / "site", {}, distribution="routed", plugin_objects={"routed": "RoutedPlugin"},
                          models={"routed": (CORE_MOE_MODEL, {"routed_tiny": "name: routed\nnum_experts: 4\n"
                                                              "num_experts_per_tok: 2\nmoe_intermediate_size: 16\n"
                                                              "score_function: sigmoid\n"
                                                              "router_bias_update_rate: 0.01\nvocab_size: null\n"})})
    routed = [*TINY, "model=routed_tiny", "training.steps=3"]
    reference = run_job(routed, tmp_path / "one", env=env)
    assert {"expert_load_min", "expert_load_max", "idle_experts"} <= reference.metrics[-1].keys()  # ExpertRouting's
    # The core's experts on this CPU pad each expert's batch to the busiest one's: more rows than copies routed, the
    # load the planner's --expert-load takes.
    assert reference.metrics[-1]["expert_rank_load_max"] > 1
    # ExpertRouting's micro-batch context ran: one micro-batch a logged step is the step's load.
    assert reference.metrics[-1]["expert_rank_load_peak"] == pytest.approx(reference.metrics[-1]["expert_rank_load_max"])
    bias = reference.final_weights()["blocks.1.mlp.gate.expert_bias"]
    # Moved by 0.01 up or down after each of the 3 steps: an odd number of hundredths, never 0.
    assert torch.equal((bias.abs() * 100).round() % 2, torch.ones(4)), bias
    result = run_job([*routed, "+plugins=[fsdp,ep]", "plugins.fsdp.degree=2", "plugins.ep.degree=2"],
                     tmp_path / "ep", env=env)
    report = compare(result, reference)
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report
    assert result.metrics[-1]["expert_rank_load_max"] > 1
    # The planner prices what ExpertRouting's own hooks issue: the model plugin's estimate_costs runs after the
    # enabled plugins', and this outsider's bias update sums its 2 layers' x 4 experts' counts once a step.
    planned = subprocess.run([sys.executable, "-m", "titan_core.planner", "--hardware", "a100", *routed,
                              "+plugins=[fsdp,ep]", "plugins.fsdp.degree=2", "plugins.ep.degree=2"],
                             capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    assert planned.returncode == 0, planned.stderr
    assert "collective routed: all-reduce of the experts' token counts over dp_shard: 32 B per step" in planned.stdout


# Low-rank attention written from docs/writing-models.md's MLA paragraph: a down-projection every tp rank runs whole
# (block_replicated), split up-projections, and one key part every head shares passed through an identity named in
# head_shared. Without the head_shared sum, the ranks' copies of `down` would drift apart (final weights disagree).
LATENT_MODEL = """
import torch
from torch import nn

from titan_core import (CORE_ATTENTION, ModelDescription, ParamInit, TensorParallelLayout, causal_attention,
                        hookimpl)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.down = nn.Linear(dim, dim // 2 + 4, bias=False)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv_up = nn.Linear(dim // 2, 2 * dim - 4 * heads, bias=False)
        self.shared = nn.Identity()
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, document_ids=None):
        b, s, d = x.shape
        latent, shared_key = self.down(x).split([d // 2, 4], -1)
        q = self.q(x).view(b, s, -1, d // self.heads)
        k, v = self.kv_up(latent).view(b, s, q.shape[2], -1).split([d // self.heads - 4, d // self.heads], -1)
        k = torch.cat([k, self.shared(shared_key)[:, :, None].expand(-1, -1, q.shape[2], -1)], -1)
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids)
        return self.out(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)

    def forward(self, x, document_ids=None):
        return x + self.attn(self.norm(x), document_ids)


class Latent(nn.Module):
    def __init__(self, vocab, dim, heads, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, document_ids=None):
        h = self.embed(tokens)
        for block in self.blocks.values():
            h = block(h, document_ids)
        return self.head(self.norm(h))


@hookimpl
def describe_model(model_config, vocab_size, seq_len):
    layout = TensorParallelLayout(block_colwise=("attn.q", "attn.kv_up"), block_rowwise=("attn.out",),
                                  block_norms=("norm",), block_regions=("attn",), embeddings=("embed",),
                                  final_norms=("norm",), output="head", block_replicated=("attn.down",),
                                  head_shared=("attn.shared",))
    return ModelDescription(family="latent", args=(vocab_size, 32, 4, 2), n_layers=2, blocks="blocks",
                            inputs=("embed",), outputs=("norm", "head"), tensor_parallel=layout,
                            attention=CORE_ATTENTION, position_buffers=(),
                            param_init=lambda name: ParamInit.constant(1.0) if "norm" in name else ParamInit.normal(0.1),
                            flops_per_token=lambda seq: 6.0 * seq)


@hookimpl
def build_model(description):
    return Latent(*description.args)
"""


@pytest.mark.slow
def test_an_outside_low_rank_attention_splits_by_heads_like_one_process(tmp_path):
    env = install_plugins(tmp_path / "site", {}, distribution="latent",
                          models={"latent": (LATENT_MODEL, {"latent_tiny": "name: latent\n"})})
    model = [*TINY, "model=latent_tiny", "training.steps=3"]
    reference = run_job(model, tmp_path / "one", env=env)
    report = compare(run_job([*model, "+plugins=[tp]", "plugins.tp.degree=2"], tmp_path / "tp", env=env), reference)
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report


SINK_MODEL = """
import torch
from torch import nn

from titan_core import (CORE_ATTENTION, ModelDescription, ParamInit, TensorParallelLayout, causal_attention,
                        hookimpl)


class Attention(nn.Module):
    def __init__(self, dim, heads, window):
        super().__init__()
        self.heads, self.window = heads, window
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim // 2, bias=False)  # half as many key-value heads: grouped by 2
        self.v = nn.Linear(dim, dim // 2, bias=False)
        self.sinks = nn.Parameter(torch.zeros(heads))
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, document_ids=None):
        b, s, d = x.shape
        q = self.q(x).view(b, s, -1, d // self.heads)
        k = self.k(x).view(b, s, -1, d // self.heads)
        v = self.v(x).view(b, s, -1, d // self.heads)
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids,
                               window=self.window, sinks=self.sinks)
        return self.out(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, window):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, window)

    def forward(self, x, document_ids=None):
        return x + self.attn(self.norm(x), document_ids)


class Sinky(nn.Module):
    def __init__(self, vocab, dim, heads, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads, 6 if i % 2 == 0 else None) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, document_ids=None):
        h = self.embed(tokens)
        for block in self.blocks.values():
            h = block(h, document_ids)
        return self.head(self.norm(h))


@hookimpl
def describe_model(model_config, vocab_size, seq_len):
    layout = TensorParallelLayout(block_colwise=("attn.q", "attn.k", "attn.v"), block_rowwise=("attn.out",),
                                  block_norms=("norm",), block_regions=("attn",), embeddings=("embed",),
                                  final_norms=("norm",), output="head",
                                  head_parameters=model_config.get("head_parameters", ("attn.sinks",)))
    return ModelDescription(family="sinky", args=(vocab_size, 32, 4, 2), n_layers=2, blocks="blocks",
                            inputs=("embed",), outputs=("norm", "head"), tensor_parallel=layout,
                            attention=CORE_ATTENTION, position_buffers=(),
                            param_init=lambda name: ParamInit.constant(1.0) if "norm" in name else ParamInit.normal(0.1),
                            flops_per_token=lambda seq: 6.0 * seq)


@hookimpl
def build_model(description):
    return Sinky(*description.args)
"""


@pytest.mark.slow
def test_an_outside_model_with_sinks_and_windows_splits_like_one_process(tmp_path):
    """Written from docs/writing-models.md: windows and sinks through the seam, the sinks named in head_parameters.
    tp 2 splits its heads and their sinks like one process (cp's gathered keys under windows and sinks: gpt-oss's
    tests). Without head_parameters the first forward says what is missing."""
    env = install_plugins(tmp_path / "site", {}, distribution="sinky",
                          models={"sinky": (SINK_MODEL, {"sinky_tiny": "name: sinky\n"})})
    model = [*TINY, "model=sinky_tiny", "training.steps=3"]
    reference = run_job(model, tmp_path / "one", env=env)
    report = compare(run_job([*model, "+plugins=[tp]", "plugins.tp.degree=2"], tmp_path / "tp", env=env), reference)
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report
    unsplit = run_job([*model, "+model.head_parameters=[]", "+plugins=[tp]", "plugins.tp.degree=2"], tmp_path / "unsplit",
                      env=env, expect_success=False)
    assert ("4 attention sinks for 2 query heads: under tensor parallel, list the sinks in "
            "TensorParallelLayout.head_parameters") in unsplit.stderr
