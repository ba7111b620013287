"""Hugging Face Llama folders (``config.json`` + safetensors), written from and read into titan-core's names.

    tok_embeddings.weight                  model.embed_tokens.weight
    layers.<i>.attention.wq|wk|wv|wo       model.layers.<i>.self_attn.q_proj|k_proj|v_proj|o_proj
    layers.<i>.feed_forward.w1|w3|w2       model.layers.<i>.mlp.gate_proj|up_proj|down_proj
    layers.<i>.attention_norm|ffn_norm     model.layers.<i>.input_layernorm|post_attention_layernorm
    norm.weight, output.weight             model.norm.weight, lm_head.weight

titan-core rotates consecutive pairs of each head's features (Meta's layout); ``transformers`` rotates
the first half against the second. The query and key rows are permuted per head between the two,
which leaves attention scores unchanged. Only safetensors are read: nothing is unpickled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from titan_core import ConfigError
from titan_core.model import LlamaArgs

FIELD = "plugins.checkpoint.load_path"
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
OUTER_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_name(name: str) -> str:
    if name in OUTER_NAMES:
        return OUTER_NAMES[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{LAYER_NAMES[rest]}"


def titan_name(name: str) -> str | None:
    for titan, hf in OUTER_NAMES.items():
        if name == hf:
            return titan
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        titan = {hf: t for t, hf in LAYER_NAMES.items()}.get(parts[3])
        return f"layers.{parts[2]}.{titan}" if titan else None
    return None


def halves_from_pairs(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head reordered from (x0, x1, x2, x3, ...) pairs to (x0, x2, ..., x1, x3, ...)."""
    return weight.unflatten(0, (heads, -1, 2)).transpose(1, 2).flatten(0, 2)


def pairs_from_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    return weight.unflatten(0, (heads, 2, -1)).transpose(1, 2).flatten(0, 2)


def hf_config(args: LlamaArgs, dtype: torch.dtype) -> dict:
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling_factor is not None:
        rope = {"rope_type": "llama3", "rope_theta": args.rope_theta, "factor": args.rope_scaling_factor,
                "low_freq_factor": args.rope_low_freq_factor, "high_freq_factor": args.rope_high_freq_factor,
                "original_max_position_embeddings": args.rope_original_max_positions}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps, "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "dtype": DTYPE_NAMES[dtype], "torch_dtype": DTYPE_NAMES[dtype],
        # transformers 5 reads rope_parameters; earlier versions rope_theta and rope_scaling.
        "rope_parameters": rope, "rope_theta": args.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if args.rope_scaling_factor else None,
    }


def export_hf(weights: dict[str, torch.Tensor], args: LlamaArgs, folder: Path, dtype: torch.dtype = torch.float32,
              tokenizer_file: Path | None = None, shard_bytes: int = 5 * 2**30) -> None:
    """Write ``weights`` (full tensors by titan-core name) as a Hugging Face Llama folder."""
    converted = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().to("cpu", dtype)
        if name.endswith("attention.wq.weight"):
            tensor = halves_from_pairs(tensor, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = halves_from_pairs(tensor, args.kv_heads)
        converted[hf_name(name)] = tensor.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, tensor in converted.items():
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + tensor.nbytes > shard_bytes:
            shards.append({})
        shards[-1][name] = tensor
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, folder / file, metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, file)
        index = {"metadata": {"total_size": sum(t.nbytes for t in converted.values())}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2))
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, folder / "tokenizer.json")


def read_hf_config(folder: Path) -> LlamaArgs:
    """LlamaArgs of a Hugging Face Llama folder's config.json."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(FIELD, f"{folder} has no config.json", "point it at a Hugging Face Llama folder")
    config = json.loads(path.read_text())
    if config.get("model_type") != "llama":
        raise ConfigError(FIELD, f"{path} is model_type '{config.get('model_type')}', not llama",
                          "import a Llama model")
    rope = config.get("rope_parameters") or {**(config.get("rope_scaling") or {}),
                                             "rope_theta": config.get("rope_theta", 10000.0)}
    scaled = rope.get("rope_type", rope.get("type")) == "llama3"
    intermediate = config["intermediate_size"]
    return LlamaArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads"), vocab_size=config["vocab_size"],
        # One multiple equal to the hidden size itself reproduces it exactly whatever rounding made it.
        multiple_of=intermediate, ffn_dim_multiplier=intermediate / int(2 * 4 * config["hidden_size"] / 3),
        norm_eps=config["rms_norm_eps"], rope_theta=rope["rope_theta"],
        rope_scaling_factor=rope["factor"] if scaled else None,
        rope_low_freq_factor=rope.get("low_freq_factor", 1.0), rope_high_freq_factor=rope.get("high_freq_factor", 4.0),
        rope_original_max_positions=rope.get("original_max_position_embeddings", 8192),
        max_seq_len=config.get("max_position_embeddings", 2048))


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise ConfigError(FIELD, f"{folder} has no model.safetensors or model.safetensors.index.json",
                      "point it at a Hugging Face folder with safetensors weights")


def hf_shapes(folder: Path) -> dict[str, tuple]:
    """Shapes by checkpoint key (``model.<titan name>``) from the safetensors headers, without reading weights."""
    shapes = {}
    for file in _weight_files(folder):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                titan = titan_name(name)
                if titan:
                    shapes[f"model.{titan}"] = tuple(f.get_slice(name).get_shape())
    if "model.output.weight" not in shapes and "model.tok_embeddings.weight" in shapes:
        shapes["model.output.weight"] = shapes["model.tok_embeddings.weight"]  # tied embeddings
    return shapes


def import_hf(folder: Path) -> tuple[LlamaArgs, dict[str, torch.Tensor]]:
    """The model arguments and full weights (by titan-core name) of a Hugging Face Llama folder."""
    args = read_hf_config(folder)
    weights = {}
    for file in _weight_files(folder):
        for name, tensor in load_file(file).items():
            titan = titan_name(name)
            if titan is None:
                continue
            if titan.endswith("attention.wq.weight"):
                tensor = pairs_from_halves(tensor, args.n_heads)
            elif titan.endswith("attention.wk.weight"):
                tensor = pairs_from_halves(tensor, args.kv_heads)
            weights[titan] = tensor
    if "output.weight" not in weights and "tok_embeddings.weight" in weights:
        weights["output.weight"] = weights["tok_embeddings.weight"].clone()  # tie_word_embeddings
    return args, weights
