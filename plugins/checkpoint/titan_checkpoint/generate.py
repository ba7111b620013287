"""A quick look at a trained model: its greedy continuation of a text, on one process.

    python -m titan_checkpoint.generate outputs/<run>/checkpoints/step-200 --text "Once upon a time"
    python -m titan_checkpoint.generate outputs/<run>/checkpoints/hf-step-200 --text "Once upon a time"

The model is a ``step-N`` or ``weights-step-N`` checkpoint (its shape from the run's ``config.yaml``, two folders
above it, or ``--config``) or a Hugging Face folder of a family titan-core builds. ``--logits FILE`` saves the
logits of the prompt's tokens (``--token-ids`` gives them directly), which the tests compare with transformers'.
Every step recomputes the whole sequence (no cache): this is for a look after fine-tuning, not for serving.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from titan_core import ConfigError, build_meta_model, folder_config, load_tokenizer, model_description
from titan_checkpoint.convert import read_model_weights
from titan_checkpoint.hf import load_hf_slices


def job_config(source: Path, config_path: Path | None):
    """The model and tokenizer of a Hugging Face folder, or of the run that saved a checkpoint."""
    if is_hf_folder(source):
        return folder_config(source, seq_len=1)
    config_path = config_path or source.parent.parent / "config.yaml"
    if not config_path.is_file():
        raise ConfigError("--config", f"{config_path} does not exist", "pass the run's config.yaml with --config")
    return OmegaConf.load(config_path)


def is_hf_folder(source: Path) -> bool:
    return (source / "config.json").is_file()


def load_model(source: Path, config) -> torch.nn.Module:
    """The model of ``config`` with the weights of ``source``, on the CPU in float32."""
    description = model_description(config, load_tokenizer(config.tokenizer).vocab_size)
    model = build_meta_model(config, description)
    model.to_empty(device="cpu")
    if description.init_buffers is not None:
        description.init_buffers(model)
    if is_hf_folder(source):
        load_hf_slices([model], source, description.hf)
    else:
        weights = read_model_weights(source)
        if weights.keys() != model.state_dict().keys():
            odd = sorted(weights.keys() ^ model.state_dict().keys())[0]
            raise ConfigError("checkpoint", f"{source} does not hold the weights of model '{description.family}' "
                              f"(it {'has' if odd in weights else 'lacks'} {odd})",
                              "look at the Hugging Face export, or at a merged folder of an adapter run")
        model.load_state_dict({name: tensor.float() for name, tensor in weights.items()})
    return model.eval()


@torch.no_grad()
def greedy(model, tokens: list[int], new_tokens: int, eos_id: int) -> tuple[list[int], torch.Tensor]:
    """The prompt's logits (1, len(tokens), vocabulary) and up to ``new_tokens`` tokens chosen by argmax,
    ending at the end-of-text token."""
    prompt_logits = model(torch.tensor([tokens]))
    chosen, logits = [], prompt_logits
    for _ in range(new_tokens):
        chosen.append(int(logits[0, -1].argmax()))
        if chosen[-1] == eos_id:
            break
        logits = model(torch.tensor([tokens + chosen]))
    return chosen, prompt_logits


def main(argv: list[str] | None = None) -> None:
    """Generate text from a checkpoint or a Hugging Face folder."""
    parser = argparse.ArgumentParser(prog="python -m titan_checkpoint.generate", description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a step-N or weights-step-N checkpoint, or a Hugging Face folder")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--text", help="the prompt")
    prompt.add_argument("--token-ids", help="the prompt as token ids, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=32, help="at most this many tokens are generated")
    parser.add_argument("--logits", type=Path, help="save the prompt's logits to this torch file")
    parser.add_argument("--config", type=Path, help="a checkpoint's run config.yaml (default: two folders up)")
    args = parser.parse_args(argv)
    try:
        check_arguments(args)
        config = job_config(args.model, args.config)
        tokenizer = load_tokenizer(config.tokenizer)
        ids = prompt_ids(args, tokenizer)
        config.training.seq_len = len(ids) + args.new_tokens  # the rows of the position tables
        chosen, prompt_logits = greedy(load_model(args.model, config), ids, args.new_tokens, tokenizer.eos_id)
    except ConfigError as error:  # bad input, found before anything is generated: one line, exit 2
        print(f"titan-checkpoint: error: {error}", file=sys.stderr)
        sys.exit(2)
    if args.logits is not None:
        torch.save(prompt_logits[0], args.logits)
    print(tokenizer.decode(chosen))


def check_arguments(args) -> None:
    """What the command line alone can tell is wrong, each named with its fix."""
    if not is_hf_folder(args.model) and not (args.model / ".metadata").is_file():
        raise ConfigError("model", f"{args.model} is neither a checkpoint (.metadata) nor a Hugging Face folder "
                          "(config.json)", "give a step-N or weights-step-N folder, or a Hugging Face folder")
    if args.new_tokens < 0:
        raise ConfigError("--new-tokens", f"{args.new_tokens} is negative", "give 0 or more")
    if args.text is not None and not args.text.strip():
        raise ConfigError("--text", "is empty: the model would continue from nothing", "give the prompt's text")
    if args.logits is not None and (args.logits.is_dir() or not os.access(args.logits.parent.resolve(), os.W_OK)):
        raise ConfigError("--logits", f"{args.logits} cannot be written", "give a file path in a writable folder")


def prompt_ids(args, tokenizer) -> list[int]:
    """The prompt as token ids: ``--token-ids`` as given, or the text after the begin-of-text token."""
    if args.token_ids is None:
        return [tokenizer.bos_id, *tokenizer.encode(args.text)]
    try:
        ids = [int(i) for i in args.token_ids.split(",")]
    except ValueError:
        raise ConfigError("--token-ids", f"{args.token_ids!r} is not comma-separated integers", "give e.g. 1,2,3")
    wrong = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
    if wrong:
        raise ConfigError("--token-ids", f"{wrong[0]} is not an id of the tokenizer (0 to {tokenizer.vocab_size - 1})",
                          "give ids the tokenizer has")
    return ids


if __name__ == "__main__":
    main()
