"""The transformers backend: six architectures transformers itself builds, from tiny random folders, compute
transformers' logits and gradients, train under fsdp and pp like one process, and what the backend does not
describe is refused in one line naming the architecture."""

import atexit
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from titan_core import GatedMLP, folder_config, load_tokenizer, model_description
from titan_core.testing import (CONFORMANCE, FLOAT8_LOSS_TOL, FLOAT8_PARAM_TOL, LOSS_TOL, PARAM_TOL, TINY, compare,
                                config_error, model_conformance, run_job, write_hf_folder)

transformers = pytest.importorskip("transformers")
from titan_checkpoint.generate import load_model  # noqa: E402  (after the skip: it needs safetensors)

TOLERANCE = 1e-5
TOKENS = [5, 17, 300, 42, 1000, 7, 99, 2047, 512, 3]
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             vocab_size=2048, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
ARCHITECTURES = {  # each differs from Llama in something that changes the arithmetic
    # no padding id, as the released Llamas (transformers' embedding keeps a padding id's row untrained)
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SHAPE, "pad_token_id": None},
                                                                            rope_theta=50000.0)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPE, sliding_window=4)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(  # (1 + w) norms, scaled embeddings
        **SHAPE, head_dim=16, sliding_window=4, final_logit_softcapping=30.0, query_pre_attn_scalar=16)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**SHAPE)),  # fused qkv
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE)),  # q, k and v biases
    "olmo2": lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**SHAPE)),  # q/k norms
}
# Short training jobs on a folder: the TINY run's settings with the folder's model and tokenizer.
JOB = [override for override in TINY if not override.startswith(("model=", "tokenizer.path="))]


# The first-party conformance matrix on the Llama folder: fsdp, cp, two pipeline schedules, two kinds of
# checkpointing, compile, a resume across plans. Not the cases with sequence parallel, which the backend refuses, nor
# float8, whose tolerance is the tiny models' (test_float8_computes_transformers_linears_in_float8 below).
LLAMA = write_hf_folder(transformers.LlamaForCausalLM(transformers.LlamaConfig(  # 4 layers: 2 stages of 2 per rank
    **{**SHAPE, "pad_token_id": None, "num_hidden_layers": 4})), Path(tempfile.mkdtemp(prefix="titan-")) / "llama")
atexit.register(shutil.rmtree, LLAMA.parent, True)
test_conformance_on_llama = model_conformance(["model=transformers", f"model.path={LLAMA}", "+plugins=[checkpoint]"],
                                              [case for case in CONFORMANCE if "tp2" not in case and case != "float8"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")
    return {name: write_hf_folder(make(), root / name) for name, make in ARCHITECTURES.items()}


def backend(folder) -> list[str]:
    return ["model=transformers", f"model.path={folder}", "+plugins=[checkpoint]", *JOB]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_logits_and_gradients_equal_transformers_own(folders, name):
    ours = load_model(folders[name], folder_config(folders[name], len(TOKENS), model="transformers")).train()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32).train()
    tokens = torch.tensor([TOKENS])
    for model, logits in ((ours, ours(tokens)), (theirs, theirs(tokens).logits)):
        F.cross_entropy(logits[0, :-1], tokens[0, 1:]).backward()
        model.logits = logits.detach()
    assert type(ours).__mro__[2] is type(theirs)  # transformers' own module computes
    assert (ours.logits - theirs.logits).abs().max() <= TOLERANCE and ours.logits.abs().max() > 1
    grads = dict(theirs.named_parameters())
    assert {n for n, _ in ours.named_parameters()} == grads.keys()
    for param_name, param in ours.named_parameters():
        assert (param.grad - grads[param_name].grad).abs().max() <= TOLERANCE, param_name


@pytest.fixture(scope="module")
def one_process(folders, tmp_path_factory):
    """Each architecture's run in one process (with the given extra options), made once."""
    runs = {}

    def reference(name: str, extra: tuple[str, ...] = ()):
        if (name, extra) not in runs:
            runs[name, extra] = run_job([*backend(folders[name]), *extra], tmp_path_factory.mktemp(f"{name}-one"))
        return runs[name, extra]
    return reference


NO_SP = ("plugins.tp.sequence_parallel=false",)
LORA = ("+plugins=[lora]", "plugins.lora.rank=4")
PLANS = {  # architecture, options of both runs, the plan: what each stresses
    "mistral-fsdp2-ac": ("mistral", (), ["+plugins=[fsdp,ac]", "plugins.fsdp.degree=2", "plugins.ac.mode=full"]),
    # the second stage takes the residual stream through the embeddings' place
    "mistral-pp2": ("mistral", (), ["+plugins=[pp]", "plugins.pp.degree=2", "training.grad_accum_steps=2"]),
    # biased column-wise projections; the logits split by vocabulary into the loss
    "qwen2-tp2": ("qwen2", (), ["+plugins=[tp]", "plugins.tp.degree=2", *NO_SP]),
    # the attention turned into a ring: every shard at its global positions
    "qwen2-cp2": ("qwen2", (), ["+plugins=[cp]", "plugins.cp.degree=2"]),
    # per-head norms, a scaled embedding, sliding windows; with FSDP beside
    "gemma3-fsdp2-tp2": ("gemma3", (), ["+plugins=[fsdp,tp]", "plugins.fsdp.degree=2", "plugins.tp.degree=2", *NO_SP]),
    # adapters on transformers' attention and MLP, split with their linears
    "llama-lora-fsdp2-tp2": ("llama", LORA, ["+plugins=[fsdp,tp]", "plugins.fsdp.degree=2", "plugins.tp.degree=2",
                                             *NO_SP]),
    # q/k norms over whole projections and norms after each sub-layer, on two stages
    "olmo2-pp2": ("olmo2", (), ["+plugins=[pp]", "plugins.pp.degree=2", "training.grad_accum_steps=2"]),
    # the four parallelisms on every architecture, matched or refused (docs/models/transformers.md's table)
    "mistral-tp2": ("mistral", (), ["+plugins=[tp]", "plugins.tp.degree=2", *NO_SP]),
    "phi3-fsdp2-pp2": ("phi3", (), ["+plugins=[fsdp,pp]", "plugins.fsdp.degree=2", "plugins.pp.degree=2",
                                    "training.grad_accum_steps=2"]),
    "phi3-cp2": ("phi3", (), ["+plugins=[cp]", "plugins.cp.degree=2"]),
    "qwen2-fsdp2-pp2": ("qwen2", (), ["+plugins=[fsdp,pp]", "plugins.fsdp.degree=2", "plugins.pp.degree=2",
                                      "training.grad_accum_steps=2"]),
    "olmo2-fsdp2-cp2": ("olmo2", (), ["+plugins=[fsdp,cp]", "plugins.fsdp.degree=2", "plugins.cp.degree=2"]),
    # the loss computing the logits chunk by chunk from lm_head's weight split by vocabulary (without loss parallel,
    # which qwen2-tp2 runs: on this folder its split log-sum-exp moves the first step's gradient norm by 1e-6
    # relative, which Adam turns into 1.2e-4 on one weight of a layer's o_proj, past the weights' tolerance)
    "llama-chunked-tp2": ("llama", (), ["+plugins=[tp,chunked_loss]", "plugins.tp.degree=2", *NO_SP,
                                        "plugins.tp.loss_parallel=false", "plugins.chunked_loss.chunk_tokens=40"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("plan", list(PLANS))
def test_trains_under_each_plan_like_one_process(folders, one_process, plan, tmp_path):
    name, both, overrides = PLANS[plan]
    result = run_job([*backend(folders[name]), *both, *overrides], tmp_path / "run")
    reference = one_process(name, both)
    report = compare(result, reference)
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report
    held = [float(m) for m in re.findall(r"([0-9.]+)M parameters held locally", result.stdout)]
    whole = float(re.findall(r"([0-9.]+)M parameters held locally", reference.stdout)[0])
    splits = not plan.endswith("-cp2") or "fsdp" in plan  # cp alone splits tokens, not weights
    assert held and all(h < whole for h in held) == splits, (held, whole)
    assert "'cp': 2" in result.stdout or not plan.endswith("cp2")


@pytest.mark.slow
def test_float8_computes_transformers_linears_in_float8(folders, one_process, tmp_path):
    """The losses move from one fp32 process's by float8's rounding, never by nothing. The folder's weights, drawn
    large (write_hf_folder), round more than the tiny models': the native llama3 plugin moves by the same 1.1e-2 on
    such a folder (measured), a wrong scale or a dropped cast by more than 0.1."""
    report = compare(run_job([*backend(folders["llama"]), "+plugins=[float8]"], tmp_path / "run"),
                     one_process("llama"))
    assert 0 < report.max_loss_diff <= 2 * FLOAT8_LOSS_TOL and report.max_param_diff <= FLOAT8_PARAM_TOL, report


@pytest.mark.slow
def test_a_trained_model_exports_to_a_folder_transformers_reads(folders, tmp_path):
    """Gemma 3 trained under FSDP: the Hugging Face export (the folder's names and config.json) gives transformers the
    trained model's logits."""
    run_job([*backend(folders["gemma3"]), "+plugins=[fsdp]", "plugins.fsdp.degree=2", "training.steps=3",
             "plugins.checkpoint.export_hf=true"], tmp_path)
    tokens = torch.tensor([TOKENS])
    with torch.no_grad():
        trained = load_model(tmp_path / "checkpoints" / "step-3", OmegaConf.load(tmp_path / "config.yaml"))(tokens)
        start = load_model(folders["gemma3"], folder_config(folders["gemma3"], 32, model="transformers"))(tokens)
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / "hf-step-3",
                                                                     dtype=torch.float32)(tokens).logits
    assert (exported - trained).abs().max() <= TOLERANCE and (trained - start).abs().max() > 1e-3


def test_generate_continues_a_folder_of_any_architecture_as_transformers_does(folders):
    """Mistral, which no native plugin reads: the generate command builds it through the backend when asked to, and
    continues the prompt greedily as transformers' own generate does."""
    prompt = TOKENS[:4]
    command = [sys.executable, "-m", "titan_checkpoint.generate", str(folders["mistral"]), "--model-plugin",
               "transformers", "--token-ids", ",".join(map(str, prompt)), "--new-tokens", "6"]
    printed = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["mistral"], dtype=torch.float32)
    continued = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    tokenizer = load_tokenizer(folder_config(folders["mistral"], 32, model="transformers").tokenizer)
    assert printed.rstrip("\n") == tokenizer.decode(continued[0, len(prompt):].tolist())


@pytest.mark.slow
def test_llama_trains_alike_through_the_native_plugin_and_the_backend(folders, tmp_path):
    native = run_job(["model=hf", f"model.path={folders['llama']}", "+plugins=[checkpoint]", *JOB], tmp_path / "native")
    generic = run_job(backend(folders["llama"]), tmp_path / "generic")
    assert max(abs(a - b) for a, b in zip(native.losses, generic.losses)) <= LOSS_TOL
    assert len(generic.losses) == 5 and "model transformers:LlamaForCausalLM" in generic.stdout


@pytest.mark.slow
def test_the_planner_prices_the_backend_as_the_native_model(folders):
    """The planner traces transformers' module as any model: the Llama folder planned through the backend holds the
    native plugin's parameters, gradients and optimizer state, rank by rank, under FSDP 2 x TP 2."""
    def planned(model: str) -> dict[str, str]:
        printed = subprocess.run([sys.executable, "-m", "titan_core.planner", model, f"model.path={folders['llama']}",
                                  "+plugins=[checkpoint,fsdp,tp]", "plugins.fsdp.degree=2", "plugins.tp.degree=2",
                                  *NO_SP, "training.seq_len=32", "training.global_batch_size=8"],
                                 capture_output=True, text=True, check=True).stdout
        return dict(re.findall(r"^    (parameters|gradients|optimizer) +(.+)$", printed, re.MULTILINE))
    native, backend = planned("model=hf"), planned("model=transformers")
    assert len(native) == 3 and backend == native, (backend, native)


@pytest.mark.parametrize("name, plan, refusal", [
    ("phi3", ["+plugins=[tp]", "plugins.tp.degree=2"], "model 'transformers:Phi3ForCausalLM' does not describe "
     "tensor_parallel, which tensor parallel needs"),  # fused projections transformers gathers whole again
    ("qwen2", ["+plugins=[tp]", "plugins.tp.degree=2"], "plugins.tp.sequence_parallel: model "
     "'transformers:Qwen2ForCausalLM' cannot take a residual stream split by sequence"),
    ("mistral", ["+plugins=[cp]", "plugins.cp.degree=2"], "model 'transformers:MistralForCausalLM' does not "
     "describe attention, which context parallel"),  # a sliding window: transformers' masks, no ring
    ("gemma3", ["+plugins=[cp]", "plugins.cp.degree=2"], "model 'transformers:Gemma3ForCausalLM' does not "
     "describe attention, which context parallel"),  # sliding layers
    ("olmo2", ["+plugins=[tp]", "plugins.tp.degree=2"], "model 'transformers:Olmo2ForCausalLM' does not describe "
     "tensor_parallel, which tensor parallel needs"),  # its attention's projections gathered whole
    ("llama", ["training.attention_mask=block_causal"], "model 'transformers:LlamaForCausalLM' attends through "
     "'sdpa_causal', which cannot mask documents"),  # transformers' layers never call the core's attention
    ("gemma3", ["training.attention_mask=block_causal"], "model 'transformers:Gemma3ForCausalLM' describes no "
     "attention seam, which cannot mask documents"),
])
def test_what_the_backend_does_not_describe_is_refused_naming_the_architecture(folders, name, plan, refusal):
    assert refusal in str(config_error(*backend(folders[name]), *plan))


def test_a_soft_capped_model_refuses_pipeline_stages_and_a_tied_one_is_refused(folders, tmp_path):
    error = config_error(*backend(folders["gemma3"]), "+plugins=[pp]", "plugins.pp.degree=2")
    assert "model 'transformers:Gemma3ForCausalLM' does not describe outputs" in str(error)
    tied = write_hf_folder(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **{**SHAPE, "tie_word_embeddings": True})), tmp_path / "tied")
    error = config_error(*backend(tied))
    assert str(error).startswith("model.path: Qwen2ForCausalLM ties its output layer to its embeddings")


def test_a_swiglu_is_described_where_the_layers_have_one(folders):
    """What module overrides swap: not Gemma's GELU feed-forward, nor Phi-3's fused gate and up."""
    described = {name: model_description(folder_config(folder, 32, model="transformers"), 2048).gated_mlp
                 for name, folder in folders.items()}
    assert {name for name, mlp in described.items() if mlp} == {"llama", "mistral", "qwen2", "olmo2"}
    assert described["llama"] == GatedMLP("mlp", gate="gate_proj", up="up_proj", down="down_proj")


def test_model_name_null_leaves_a_folder_to_its_family_plugin(folders):
    """Asked beside the native plugins (model=hf), the backend claims no folder: a Llama folder stays llama3's, and
    a Mistral folder no installed plugin reads says so and how to train it anyway."""
    assert folder_config(folders["llama"], 32).model.name == "llama3"
    error = config_error("model=hf", f"model.path={folders['mistral']}")
    assert "model_type 'mistral'" in str(error)
