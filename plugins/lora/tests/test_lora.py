"""LoRA against transformers + PEFT: from the same adapter weights, the same batches and the same AdamW, our losses
are PEFT's; our adapter export read by PEFT gives the trained model's logits; the merged folder gives them in
transformers alone; every plan equals one process; the optimizer holds state for the adapters only."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from titan_core.testing import LOSS_TOL, PARAM_TOL, config_error, error_line, install_plugins, run_job, write_hf_folder

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RANK, ALPHA, STEPS, LR = 4, 8.0, 4, 1e-2
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOGIT_TOLERANCE = 1e-5
TRAJECTORY_TOLERANCE = 1e-4  # the logits move by ~4: a wrong adapter or scale is off by far more
TOKENS = torch.tensor([[5, 17, 300, 42, 1000, 7, 99, 2047, 512, 3]])

# Writes each training micro-batch it sees: PEFT then trains on exactly these.
RECORDER = """
import torch
from titan_core import hookimpl


class Recorder:
    def __init__(self):
        self.seen = 0

    @hookimpl
    def batch_context(self, inputs, labels, model_parts, plugin_config):
        if model_parts[0].training:
            torch.save({"inputs": inputs.clone(), "labels": labels.clone()}, f"{plugin_config.out}/batch{self.seen}.pt")
            self.seen += 1
"""


def qwen3() -> torch.nn.Module:
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=2048, rms_norm_eps=1e-6, rope_theta=20000.0, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A Qwen3 folder transformers wrote, and a PEFT adapter on it whose B is not zero (so the first step already
    trains both matrices)."""
    root = tmp_path_factory.mktemp("lora")
    base = write_hf_folder(qwen3(), root / "base")
    torch.manual_seed(1)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=MODULES, lora_dropout=0.0,
                                                init_lora_weights=False))
    model.save_pretrained(root / "adapter")
    return base, root / "adapter"


def lora_job(base: Path, adapter: Path, *extra: str, plugins: str = "") -> list[str]:
    return ["model=hf", f"model.path={base}", f"+plugins=[checkpoint,lora{plugins}]", f"plugins.lora.rank={RANK}",
            f"plugins.lora.alpha={ALPHA}", f"plugins.lora.init_from={adapter}", f"training.steps={STEPS}",
            "training.seq_len=32", "training.global_batch_size=4", f"optimizer.lr={LR}", "lr_scheduler.warmup_steps=0",
            "lr_scheduler.decay=none", "training.max_norm=null", "metrics.log_every=1", "metrics.tensorboard=false",
            "plugins.checkpoint.interval=2", "launch.device=cpu", *extra]


def losses(run: Path) -> list[float]:
    return [line["loss"] for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in line]


@pytest.fixture(scope="module")
def one_process(start, tmp_path_factory):
    base, adapter = start
    run = tmp_path_factory.mktemp("one")
    (run / "batches").mkdir()
    env = install_plugins(run / "site", {"recorder": (RECORDER, "out: null\n")}, distribution="recorder",
                          plugin_objects={"recorder": "Recorder"})
    result = run_job([*lora_job(base, adapter, f"plugins.recorder.out={run / 'batches'}", "plugins.lora.export=both",
                                plugins=",recorder")], run / "run", env=env)
    return result


def peft_training(base: Path, adapter: Path, batches: Path):
    """STEPS steps of transformers + PEFT on the recorded batches, with torch's AdamW as titan-core sets it up."""
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                           adapter, is_trainable=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    found = []
    for step in range(STEPS):
        batch = torch.load(batches / f"batch{step}.pt")
        logits = model(batch["inputs"]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        found.append(loss.item())
    return model.eval(), found


@pytest.mark.slow
def test_lora_trains_as_peft_does_and_peft_reads_its_adapter(start, one_process, tmp_path):
    base, adapter = start
    model, expected = peft_training(base, adapter, one_process.run_dir.parent / "batches")
    ours = losses(one_process.run_dir)
    print(f"losses, ours vs PEFT: {ours} vs {expected}; max diff {max(abs(a - b) for a, b in zip(ours, expected)):.2e}")
    assert len(ours) == STEPS and max(abs(a - b) for a, b in zip(ours, expected)) <= 1e-5
    assert ours[-1] < ours[0] - 0.05  # it learned: a frozen or unread adapter would not

    exported = one_process.run_dir / f"adapter-step-{STEPS}"
    reread = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                            exported).eval()
    with torch.no_grad():
        trained, read_back = model(TOKENS).logits, reread(TOKENS).logits
        untrained = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(TOKENS).logits
    merged = tmp_path / "merged"
    subprocess.run([sys.executable, "-m", "titan_lora.merge", str(base), str(exported), str(merged)], check=True,
                   capture_output=True)
    # The run's own merged export (plugins.lora.export=both) is the merge tool's folder, tensor for tensor.
    exported_merged = one_process.run_dir / f"merged-step-{STEPS}"
    assert sorted(p.name for p in exported_merged.iterdir()) == sorted(p.name for p in merged.iterdir())
    for file in merged.glob("*.safetensors"):
        ours, tools = load_file(exported_merged / file.name), load_file(file)
        assert ours.keys() == tools.keys() and all(torch.equal(ours[k], tools[k]) for k in ours)
    with torch.no_grad():
        alone = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(TOKENS).logits
    print(f"PEFT reading our adapter vs transformers on the merged folder: {(read_back - alone).abs().max().item():.2e}; "
          f"vs PEFT's own training: {(read_back - trained).abs().max().item():.2e} (training moved the logits "
          f"{(trained - untrained).abs().max().item():.3f})")
    assert (read_back - alone).abs().max().item() <= LOGIT_TOLERANCE
    # Two trajectories of AdamW (lr 1e-2) four steps long, whose losses agreed to 1e-6 at every step.
    assert (read_back - trained).abs().max().item() <= TRAJECTORY_TOLERANCE


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_not_the_frozen_base(one_process, start):
    """14 adapted linears (7 per block), two matrices each: the checkpoint holds those 28 weights and AdamW's
    moments for them; the frozen base is read from the folder the run started from."""
    folder = one_process.run_dir / "checkpoints" / f"step-{STEPS}"
    saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    weights = sorted(k for k in saved if k.startswith("model."))
    moments = sorted(k for k in saved if k.startswith("optimizer.") and k.endswith(".exp_avg"))
    assert len(weights) == len(moments) == 28 and all(".lora_A." in k or ".lora_B." in k for k in weights + moments)
    # rank 4 x (in + out) of each block's 7 linears (64-64, 64-32, 64-32, 64-64, 64-96, 64-96, 96-64), 2 blocks
    assert sum(saved[k].size.numel() for k in moments) == 4 * (128 + 96 + 96 + 128 + 160 + 160 + 160) * 2 == 7_424
    held = sum(saved[k].size.numel() * saved[k].properties.dtype.itemsize for k in saved
               if k.startswith(("model.", "optimizer.")))
    files = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    base = (start[0] / "model.safetensors").stat().st_size
    print(f"checkpoint: {held} bytes of weights and moments ({files} bytes of files); the base's weights {base} bytes")
    assert held * 10 < base
    looked = subprocess.run([sys.executable, "-m", "titan_checkpoint.generate", str(folder), "--text", "hi"],
                            capture_output=True, text=True)
    assert looked.returncode == 2 and "does not hold the weights of model 'qwen3'" in looked.stderr


@pytest.mark.slow
@pytest.mark.parametrize("plugin, options", [("", []), (",fsdp", ["plugins.fsdp.degree=2"])], ids=["same", "fsdp2"])
def test_a_resumed_run_continues_the_uninterrupted_one(start, one_process, plugin, options, tmp_path):
    """Resumed from the step-2 checkpoint (adapters and optimizer state; the base from the folder), under the same
    plan bit for bit, resharded over two FSDP ranks within the tolerance."""
    base, adapter = start
    shutil.copytree(one_process.run_dir / "checkpoints" / "step-2", tmp_path / "checkpoints" / "step-2")
    run_job(lora_job(base, adapter, *options, plugins=plugin), tmp_path)
    resumed, whole = losses(tmp_path), losses(one_process.run_dir)[2:]
    print(f"resumed{plugin or ' alike'}: {resumed} vs {whole}")
    assert len(resumed) == 2
    if plugin:
        assert max(abs(a - b) for a, b in zip(resumed, whole)) <= LOSS_TOL
    else:
        assert resumed == whole


@pytest.mark.slow
@pytest.mark.parametrize("plugin, options", [("pp", ["plugins.pp.degree=2", "training.grad_accum_steps=2"]),
                                             ("cp", ["plugins.cp.degree=2"]), ("ac,compile", []),
                                             ("fsdp,tp", ["plugins.fsdp.degree=2", "plugins.tp.degree=2"]),
                                             ("tp", ["plugins.tp.degree=2", "plugins.tp.sequence_parallel=false"]),
                                             ("tp,ac,compile", ["plugins.tp.degree=2", "plugins.ac.mode=selective_op"])],
                         ids=["pp2", "cp2", "ac-compile", "fsdp2-tp2-sp", "tp2", "tp2-compile-sac"])  # fsdp: resumed under two shards, below
def test_every_plan_equals_one_process(start, one_process, plugin, options, tmp_path):
    """Each plan's losses, and the adapters it exports, are one process's. Under tp the adapters are split like
    their linears, and the frozen norms stay frozen (torch's replicated norm weights came back trainable: 0.016
    off in the loss with sequence parallel, 0.011 without)."""
    base, adapter = start
    result = run_job(lora_job(base, adapter, *options, plugins=f",{plugin}"), tmp_path)
    ours, reference = losses(result.run_dir), losses(one_process.run_dir)
    print(f"{plugin}: max loss diff to one process {max(abs(a - b) for a, b in zip(ours, reference)):.2e}")
    assert max(abs(a - b) for a, b in zip(ours, reference)) <= LOSS_TOL
    exported = [load_file(run / f"adapter-step-{STEPS}" / "adapter_model.safetensors")
                for run in (result.run_dir, one_process.run_dir)]
    assert exported[0].keys() == exported[1].keys()
    assert max((exported[0][k] - exported[1][k]).abs().max().item() for k in exported[1]) <= PARAM_TOL


# Lists, once the model is built, the adapted linears: whether each computes in float8, the dtype its base weight
# is held in on this rank, and its adapter's.
INSPECTOR = """
import json
from torchao.float8.float8_linear import Float8Linear
from titan_core import hookimpl, local_box


@hookimpl
def after_init(model_parts, plugin_config):
    adapted = {name: {"float8": isinstance(module, Float8Linear), "base": str(local_box(module.weight)[0].dtype),
                      "adapter": str(local_box(module.lora_A.weight)[0].dtype)}
               for part in model_parts for name, module in part.named_modules() if hasattr(module, "lora_A")}
    with open(plugin_config.out, "w") as file:
        json.dump(adapted, file)
"""


# Float8 rounds each activation with a scale from its own rank's rows (tensorwise amax), so plans differ by the
# rounding: 0.012 in the loss over these 4 steps at lr 1e-2 (fp32 vs float8, one process or fsdp 2). A wrong
# scale or an untrained adapter is off by more than 0.1 (training moves the loss 0.27).
FLOAT8_LORA_TOL = 0.03
# The frozen linears rounded to bfloat16 (relative 2^-9) under float32 compute; training moves the loss 0.27.
BF16_BASE_TOL = 0.01


@pytest.mark.slow
def test_adapters_on_a_float8_base_under_fsdp_train_like_one_fp32_process(start, one_process, tmp_path):
    """TorchTitan's float8_emulate_lora case: the frozen base computes in float8 (tensorwise, emulated on the CPU),
    the adapters in fp32, over two FSDP ranks."""
    base, adapter = start
    env = install_plugins(tmp_path / "site", {"inspector": (INSPECTOR, "out: null\n")}, distribution="inspector")
    result = run_job(lora_job(base, adapter, "plugins.fsdp.degree=2", f"plugins.inspector.out={tmp_path / 'adapted.json'}",
                              plugins=",float8,fsdp,inspector"), tmp_path / "run", env=env)
    adapted = json.loads((tmp_path / "adapted.json").read_text())
    assert len(adapted) == 14 and all(linear["float8"] for linear in adapted.values()), adapted  # 7 a block
    ours, fp32 = losses(result.run_dir), losses(one_process.run_dir)
    print(f"float8 base + adapters under fsdp 2: {ours}; fp32, one process: {fp32}")
    assert 1e-3 < max(abs(a - b) for a, b in zip(ours, fp32)) <= FLOAT8_LORA_TOL  # rounded, and as close as that
    assert ours[-1] < ours[0] - 0.2  # the adapters learn through the float8 base


@pytest.mark.slow
def test_a_bfloat16_base_changes_nothing_under_bfloat16_compute_and_trains_under_fsdp(start, tmp_path):
    """Autocast rounds the frozen linears to bfloat16 for every matmul anyway: held in bfloat16 (half the bytes),
    they give the same losses bit for bit. Under FSDP (float32 compute on the CPU) the bfloat16 shards train the
    adapters as the float32 base does, within the rounding of the weights."""
    base, adapter = start
    env = install_plugins(tmp_path / "site", {"inspector": (INSPECTOR, "out: null\n")}, distribution="inspector")
    runs = {}
    for name, options in {"fp32": ["training.compute_dtype=bfloat16"],
                          "bf16": ["training.compute_dtype=bfloat16", "plugins.lora.base_dtype=bfloat16"],
                          "fp32-fsdp": ["plugins.fsdp.degree=2"],
                          "bf16-fsdp": ["plugins.fsdp.degree=2", "plugins.lora.base_dtype=bfloat16"]}.items():
        out = tmp_path / f"{name}.json"
        result = run_job(lora_job(base, adapter, *options, f"plugins.inspector.out={out}",
                                  plugins=",inspector" + (",fsdp" if "fsdp" in name else "")), tmp_path / name, env=env)
        runs[name] = losses(result.run_dir), json.loads(out.read_text())
    for name, (trained, adapted) in runs.items():
        held = "torch.bfloat16" if name.startswith("bf16") else "torch.float32"
        assert len(adapted) == 14 and all(a["base"] == held and a["adapter"] == "torch.float32"
                                          for a in adapted.values()), (name, adapted)
    drift = max(abs(a - b) for a, b in zip(runs["bf16-fsdp"][0], runs["fp32-fsdp"][0]))
    print(f"bf16 base: {runs['bf16'][0]} (fp32 base, bf16 autocast: {runs['fp32'][0]}); under fsdp 2 "
          f"{runs['bf16-fsdp'][0]}, {drift:.1e} from the fp32 base")
    assert runs["bf16"][0] == runs["fp32"][0]
    assert 0 < drift <= BF16_BASE_TOL and runs["bf16-fsdp"][0][-1] < runs["bf16-fsdp"][0][0] - 0.2


def qwen3_moe() -> torch.nn.Module:
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        vocab_size=2048, rms_norm_eps=1e-6, rope_theta=20000.0, tie_word_embeddings=False))


EXPERT_STACKS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def experts_start(tmp_path_factory):
    """A Qwen3-MoE folder transformers wrote (each expert's projections apart, as released), a PEFT adapter on its
    attention and on its experts' stacked weights (``target_parameters``, B not zero), and one process's run."""
    root = tmp_path_factory.mktemp("lora-experts")
    base = write_hf_folder(qwen3_moe(), root / "base")
    torch.manual_seed(2)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=MODULES[:4],
                                                target_parameters=EXPERT_STACKS, init_lora_weights=False))
    model.save_pretrained(root / "adapter")
    (root / "batches").mkdir()
    env = install_plugins(root / "site", {"recorder": (RECORDER, "out: null\n")}, distribution="recorder",
                          plugin_objects={"recorder": "Recorder"})
    one = run_job(lora_job(base, root / "adapter", "plugins.lora.targets=[attention,experts]",
                           f"plugins.recorder.out={root / 'batches'}", plugins=",recorder"), root / "one", env=env)
    return base, root / "adapter", one


@pytest.mark.slow
def test_adapters_on_experts_train_as_peft_does_and_under_expert_parallel_like_one_process(experts_start, tmp_path):
    """Each expert of each block gets its own pair on each stacked weight: from PEFT's adapter, our losses are
    PEFT's (``target_parameters``), PEFT reads our export as the model we trained, and two ranks splitting the
    experts (fsdp 2 x ep 2) train as one process. The checkpoint holds the factors, not the frozen stacks."""
    base, adapter, one = experts_start
    model, expected = peft_training(base, adapter, one.run_dir.parent / "batches")
    ours = losses(one.run_dir)
    print(f"experts: losses, ours vs PEFT: {ours} vs {expected}; max diff "
          f"{max(abs(a - b) for a, b in zip(ours, expected)):.2e}")
    assert len(ours) == STEPS and max(abs(a - b) for a, b in zip(ours, expected)) <= 1e-5
    assert ours[-1] < ours[0] - 0.05

    exported = one.run_dir / f"adapter-step-{STEPS}"
    assert json.loads((exported / "adapter_config.json").read_text())["target_parameters"] == EXPERT_STACKS
    reread = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                            exported).eval()
    with torch.no_grad():
        trained, read_back = model(TOKENS).logits, reread(TOKENS).logits
    print(f"PEFT reading our expert adapters vs its own training: {(read_back - trained).abs().max().item():.2e}")
    assert (read_back - trained).abs().max().item() <= TRAJECTORY_TOLERANCE

    folder = one.run_dir / "checkpoints" / f"step-{STEPS}"
    saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    stacks = sorted(k for k in saved if k.startswith("model.") and ".experts." in k)
    assert stacks == sorted(f"model.layers.{block}.mlp.experts.{stack}_lora_{which}"
                            for block in (0, 1) for stack in ("gate_up_proj", "down_proj") for which in "AB")
    # (experts, rank, in) and (experts, out, rank): 4 x 4 x (64 + 64) + 4 x 4 x (32 + 64), a block
    assert sum(saved[k].size.numel() for k in stacks) == 2 * (4 * 4 * (64 + 64) + 4 * 4 * (32 + 64))

    split = run_job(lora_job(base, adapter, "plugins.lora.targets=[attention,experts]", "plugins.fsdp.degree=2",
                             "plugins.ep.degree=2", plugins=",fsdp,ep"), tmp_path / "ep")
    diff = max(abs(a - b) for a, b in zip(losses(split.run_dir), ours))
    files = [load_file(run / f"adapter-step-{STEPS}" / "adapter_model.safetensors") for run in (split.run_dir, one.run_dir)]
    drift = max((files[0][k] - files[1][k]).abs().max().item() for k in files[1])
    print(f"fsdp 2 x ep 2 vs one process: losses {diff:.2e}, exported adapters {drift:.2e}")
    assert files[0].keys() == files[1].keys() and diff <= LOSS_TOL and drift <= PARAM_TOL

    merged = subprocess.run([sys.executable, "-m", "titan_lora.merge", str(base), str(exported), str(tmp_path / "m")],
                            capture_output=True, text=True)
    assert merged.returncode == 2 and "merge it with PEFT" in merged.stderr.strip().splitlines()[-1]


def test_what_lora_cannot_do_is_refused(start):
    base, adapter = start
    job = ["model=hf", f"model.path={base}", "+plugins=[checkpoint,lora]"]
    error = config_error(*job, "plugins.lora.targets=[experts]")
    assert error.field == "plugins.lora.targets" and "does not describe experts, which lora on experts" in str(error)
    assert "unknown target 'attn'" in str(config_error(*job, "plugins.lora.targets=[attn]"))
    assert str(config_error(*job, "plugins.lora.base_dtype=bfloat16")) == (
        "plugins.lora.base_dtype: a bfloat16 base needs bfloat16 compute or a plugin's mixed precision, and this job "
        "computes in float32; fix: set training.compute_dtype=bfloat16")
    error = config_error(*job, f"plugins.lora.init_from={adapter}", "plugins.lora.rank=8")
    assert error.field == "plugins.lora.rank" and f"8 disagrees with {RANK}" in str(error)
    assert config_error(*job, "plugins.lora.rank=0").field == "plugins.lora.rank"
    assert config_error(*job, "plugins.lora.dropout=1.0").field == "plugins.lora.dropout"
    error = config_error("model=hf", f"model.path={base}", "+plugins=[checkpoint,lora,tp]", "plugins.tp.degree=2",
                         "plugins.lora.dropout=0.1")
    assert error.field == "plugins.lora.dropout" and "under tensor parallel" in str(error)


@pytest.mark.parametrize("peft_options, field", [
    ({"rank_pattern": {"q_proj": 8}}, 'rank_pattern={"q_proj": 8} (a rank per module)'),
    ({"alpha_pattern": {"v_proj": 32.0}}, 'alpha_pattern={"v_proj": 32.0} (an alpha per module)'),
    ({"use_dora": True}, "use_dora=true (DoRA's magnitude vectors)"),
], ids=["rank_pattern", "alpha_pattern", "dora"])
def test_an_adapter_whose_math_lora_does_not_compute_is_refused(start, tmp_path, peft_options, field):
    """PEFT's per-module ranks and alphas and DoRA change what the adapter computes: its larger factor was once cut to
    the configured rank, the logits ~1.0 away from PeftModel's, without a word. Refused before launch by name, as
    the merge tool refuses it, never ignored."""
    base, _ = start
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=MODULES, lora_dropout=0.0,
                                                init_lora_weights=False, **peft_options))
    model.save_pretrained(tmp_path / "adapter")
    error = config_error("model=hf", f"model.path={base}", "+plugins=[checkpoint,lora]", f"plugins.lora.rank={RANK}",
                         f"plugins.lora.alpha={ALPHA}", f"plugins.lora.init_from={tmp_path / 'adapter'}")
    assert str(error) == (f"plugins.lora.init_from: {tmp_path / 'adapter' / 'adapter_config.json'} sets {field}, which "
                          "titan-core's LoRA does not compute; fix: start from a plain LoRA adapter, or merge this one "
                          "into its base with PEFT (merge_and_unload, save_pretrained) and train from the merged folder")
    merged = subprocess.run([sys.executable, "-m", "titan_lora.merge", str(base), str(tmp_path / "adapter"),
                             str(tmp_path / "merged")], capture_output=True, text=True)
    assert merged.returncode == 2 and f"sets {field}" in merged.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.glob("merged*"))


@pytest.mark.parametrize("key, value", [("modules_to_save", ["lm_head"]), ("layer_replication", [[0, 2]]),
                                        ("fan_in_fan_out", True), ("bias", "all"), ("lora_bias", True),
                                        ("some_future_field", 3)])
def test_every_other_field_that_changes_the_math_is_refused_by_name(start, tmp_path, key, value):
    """Every field of adapter_config.json beyond those titan-core reads or that do not change a trained adapter's
    output, set to anything but PEFT's default, is refused naming it: a field PEFT adds later too."""
    base, adapter = start
    shutil.copytree(adapter, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, key: value}))
    error = config_error("model=hf", f"model.path={base}", "+plugins=[checkpoint,lora]", f"plugins.lora.rank={RANK}",
                         f"plugins.lora.alpha={ALPHA}", f"plugins.lora.init_from={tmp_path / 'adapter'}")
    assert error.field == "plugins.lora.init_from" and f"sets {key}={json.dumps(value)}" in str(error)


def test_a_stored_factor_of_another_rank_is_refused_not_cut(start, tmp_path):
    """Factors stored at rank 8 under a config saying 4 would be copied cut to the adapters' rank 4: refused."""
    base, _ = start
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                peft.LoraConfig(r=2 * RANK, lora_alpha=ALPHA, target_modules=MODULES, lora_dropout=0.0))
    model.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "r": RANK}))
    error = config_error("model=hf", f"model.path={base}", "+plugins=[checkpoint,lora]", f"plugins.lora.rank={RANK}",
                         f"plugins.lora.alpha={ALPHA}", f"plugins.lora.init_from={tmp_path / 'adapter'}")
    assert error.field == "plugins.lora.init_from"
    assert f"has rank {2 * RANK}, not the plugins.lora.rank={RANK} its adapter_config.json says" in str(error)


@pytest.mark.parametrize("other", ["wider", "deeper", "other-modules"])
def test_an_adapter_of_another_base_is_refused_before_launch_and_merge_writes_nothing(start, tmp_path, other):
    """An adapter trained on another model: wider (the same names, other widths: its factors were copied in cut to
    fit, or training died in a copy), deeper (a block this model lacks) or on other modules. Refused before launch
    naming a factor and the adapter's base; the merge tool refuses it from the files' headers, leaving no folder."""
    base, _ = start
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96}
    shape |= {"wider": {"intermediate_size": 128}, "deeper": {"num_hidden_layers": 3}, "other-modules": {}}[other]
    donor = write_hf_folder(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **shape, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=2048, rms_norm_eps=1e-6,
        rope_theta=20000.0, tie_word_embeddings=False)), tmp_path / "donor")
    modules = ["q_proj", "v_proj"] if other == "other-modules" else MODULES
    peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(donor, dtype=torch.float32), peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=modules, lora_dropout=0.0)).save_pretrained(tmp_path / "adapter")
    error = config_error("model=hf", f"model.path={base}", "+plugins=[checkpoint,lora]", f"plugins.lora.rank={RANK}",
                         f"plugins.lora.alpha={ALPHA}", f"plugins.lora.init_from={tmp_path / 'adapter'}")
    assert error.field == "plugins.lora.init_from"
    assert {"wider": f"{tmp_path / 'adapter'}'s base_model.model.model.layers.0.mlp.down_proj.lora_A.weight is "
                     f"[{RANK}, 128], this model's adapter there [{RANK}, 96]: the adapter is of another model "
                     f"(trained on {donor})",
            "deeper": f"(trained on {donor}) has base_model.model.model.layers.2.",
            "other-modules": f"(trained on {donor}) lacks base_model.model.model.layers.0.mlp.down_proj.lora_A"}[other] \
        in str(error)
    merged = subprocess.run([sys.executable, "-m", "titan_lora.merge", str(base), str(tmp_path / "adapter"),
                             str(tmp_path / "merged")], capture_output=True, text=True)
    if other == "other-modules":  # a subset of this model's weights: a merge onto it is what was asked
        assert merged.returncode == 0, merged.stderr
        return
    assert merged.returncode == 2 and merged.stderr.strip().splitlines() == [{
        "wider": f"titan-lora: error: {base}'s model.layers.0.mlp.down_proj.weight is [64, 96], the adapter's update "
                 f"of it [64, 128]: {tmp_path / 'adapter'} was trained on another model (it was trained on {donor})",
        "deeper": f"titan-lora: error: {base} lacks the weights the adapter changes (e.g. "
                  f"model.layers.2.mlp.down_proj.weight): is it the adapter's base (it was trained on {donor})?"}[other]]
    assert not list(tmp_path.glob("merged*"))


def test_a_hugging_face_export_of_a_lora_model_is_refused_before_training(start, tmp_path):
    base, _ = start
    result = run_job(["model=hf", f"model.path={base}", "+plugins=[checkpoint,lora]", "plugins.checkpoint.export_hf=true",
                      "training.steps=1", "training.seq_len=32", "training.global_batch_size=2"], tmp_path,
                     expect_success=False)
    assert result.returncode != 0 and not (tmp_path / "metrics.jsonl").exists()
    assert "export_hf: the model holds layers.0.mlp.down_proj.lora_A.weight (and 27 more)" in error_line(result)


def test_a_merged_export_without_a_base_folder_is_refused(start):
    base, _ = start
    error = config_error("model=qwen3_tiny", "tokenizer.path=bytes", "+plugins=[lora]", "plugins.lora.export=merged")
    assert str(error) == ("plugins.lora.export: merged folds the adapters into the base's Hugging Face folder, and "
                          "this job starts from none; fix: start from a folder (model=hf model.path=...), or set "
                          "plugins.lora.export=peft")
    assert config_error("model=hf", f"model.path={base}", "+plugins=[lora]", "plugins.lora.export=yes").field == \
        "plugins.lora.export"


def test_generate_folds_a_runs_adapter_into_its_base_as_the_merged_export(start, one_process, tmp_path):
    """generate --adapter on the base folder gives the logits of the run's merged export (export=both), and those of
    PEFT reading the adapter: a LoRA run looked at without writing a merged folder. An adapter of another model is one
    line."""
    base, _ = start
    exported = one_process.run_dir / f"adapter-step-{STEPS}"

    def logits(*args):
        out = tmp_path / f"logits{len(list(tmp_path.iterdir()))}.pt"
        done = subprocess.run([sys.executable, "-m", "titan_checkpoint.generate", *args, "--token-ids",
                               ",".join(map(str, TOKENS[0].tolist())), "--new-tokens", "1", "--logits", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return torch.load(out)

    folded = logits(str(base), "--adapter", str(exported))
    merged = logits(str(one_process.run_dir / f"merged-step-{STEPS}"))
    plain = logits(str(base))
    reread = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                            exported).eval()
    with torch.no_grad():
        expected = reread(TOKENS).logits[0]
    assert (folded - merged).abs().max().item() <= LOGIT_TOLERANCE
    assert (folded - expected).abs().max().item() <= LOGIT_TOLERANCE
    assert (folded - plain).abs().max().item() > 100 * LOGIT_TOLERANCE  # the adapter did change the model
    wider = write_hf_folder(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=2048, rms_norm_eps=1e-6, rope_theta=20000.0, tie_word_embeddings=False)),
        tmp_path / "wider")
    done = subprocess.run([sys.executable, "-m", "titan_checkpoint.generate", str(wider), "--adapter", str(exported),
                           "--text", "hi"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"titan-checkpoint: error: --adapter: {exported} changes model.layers.0.mlp.down_proj.weight ([64, 96]), and "
        "this model holds it as [64, 128]: the adapter is of another model; fix: give the base the adapter was trained "
        "on"]


def test_merge_without_a_base_or_an_adapter_is_one_line_exit_2(tmp_path):
    """A folder without its config file once printed argparse's usage and exited 2 with three lines."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    for base, adapter, missing in ((tmp_path, tmp_path, f"{tmp_path} has no config.json"),
                                   (base, tmp_path, f"{tmp_path} has no adapter_config.json")):
        done = subprocess.run([sys.executable, "-m", "titan_lora.merge", str(base), str(adapter), str(tmp_path / "out")],
                              capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"titan-lora: error: {missing}"]
        assert not (tmp_path / "out").exists()
