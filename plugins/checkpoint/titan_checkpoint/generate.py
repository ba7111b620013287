"""A quick look at a trained model: its continuation of a text, greedy or sampled, streamed as it comes, on one
process.

    python -m titan_checkpoint.generate outputs/<run>/checkpoints/step-200 --text "Once upon a time"
    python -m titan_checkpoint.generate outputs/<run>/checkpoints/hf-step-200 --chat --text "Who are you?" \
        --temperature 0.7 --top-p 0.9 --seed 1

The model is a ``step-N`` or ``weights-step-N`` checkpoint (its shape from the run's ``config.yaml``, two folders
above it, or ``--config``) or a Hugging Face folder of a family titan-core builds; ``--adapter`` folds a LoRA run's
PEFT adapter (``adapter-step-N``) into it first, no merged folder written. ``--chat`` sends the text as a
user's turn through the tokenizer's chat template, as transformers' ``apply_chat_template`` renders it. Greedy by
default; ``--temperature`` above 0 samples, after top-k and top-p as transformers' warpers filter (``--seed`` makes
it repeatable). Generation stops at the end-of-text token and at those a folder's ``generation_config.json`` names.
``--logits FILE`` saves the logits of the prompt's tokens (``--token-ids`` gives them directly), which the tests
compare with transformers'. Every step recomputes the whole sequence (no cache): this is for a look after
fine-tuning, not for serving.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from titan_core import (ConfigError, build_meta_model, find_chat_template, folder_config, load_tokenizer,
                        model_description, peft_updates, render_chat, tokenizer_file)
from titan_checkpoint.convert import read_model_weights
from titan_checkpoint.hf import load_hf_slices


def job_config(source: Path, config_path: Path | None, model: str | None = None):
    """The model and tokenizer of a Hugging Face folder (built by the model plugin ``model`` names, else by the one
    reading its model_type), or of the run that saved a checkpoint."""
    if is_hf_folder(source):
        return folder_config(source, seq_len=1, model=model)
    if model is not None:
        raise ConfigError("--model-plugin", f"{source} is a checkpoint, whose run config names its model",
                          "drop --model-plugin (it chooses the plugin that builds a Hugging Face folder)")
    config_path = config_path or source.parent.parent / "config.yaml"
    if not config_path.is_file():
        raise ConfigError("--config", f"{config_path} does not exist", "pass the run's config.yaml with --config")
    return OmegaConf.load(config_path)


def is_hf_folder(source: Path) -> bool:
    return (source / "config.json").is_file()


def load_model(source: Path, config, adapter: Path | None = None) -> torch.nn.Module:
    """The model of ``config`` with the weights of ``source``, on the CPU in float32, with the PEFT adapter in
    folder ``adapter`` folded in when one is given."""
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
    if adapter is not None:
        fold_adapter(model, adapter, description)
    return model.eval()


@torch.no_grad()
def fold_adapter(model: torch.nn.Module, adapter: Path, description) -> None:
    """Add each update of the PEFT adapter in ``adapter`` to the weight it adapts, found through the model's Hugging
    Face names: a LoRA run's adapter-step-N looked at without writing a merged folder."""
    try:
        updates = peft_updates(adapter)
    except ValueError as error:
        raise ConfigError("--adapter", str(error), "give a plain LoRA adapter folder (a lora run's adapter-step-N)")
    held = dict(model.named_parameters())
    for hf_name, update in sorted(updates.items()):
        weight = held.get(description.hf.from_hf(hf_name) or "")
        if weight is None or weight.shape != update.shape:
            found = "lacks it" if weight is None else f"holds it as {list(weight.shape)}"
            raise ConfigError("--adapter", f"{adapter} changes {hf_name} ({list(update.shape)}), and this model "
                              f"{found}: the adapter is of another model", "give the base the adapter was trained on")
        weight += update.to(weight.dtype)


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen: the most likely at temperature 0, else drawn from the softmax of the logits
    over ``temperature``, among the ``top_k`` most likely (0: all) and the fewest whose probability reaches
    ``top_p``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


def filtered_scores(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The scores a token is drawn from, as transformers' temperature, top-k and top-p warpers leave them, in that
    order: the tokens left out at minus infinity."""
    scores = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scores, min(sampling.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if sampling.top_p < 1:
        ordered, order = torch.sort(scores)
        dropped = ordered.softmax(-1).cumsum(-1) <= 1 - sampling.top_p
        dropped[-1] = False  # the most likely token always stays
        scores = scores.masked_fill(dropped.scatter(0, order, dropped), -math.inf)
    return scores


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    if sampling.temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(filtered_scores(logits, sampling).softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate(model, tokens: list[int], new_tokens: int, stop_ids: set[int], sampling: Sampling,
             generator: torch.Generator, on_token: Callable[[list[int]], None] = lambda chosen: None
             ) -> tuple[list[int], torch.Tensor]:
    """The prompt's logits (1, len(tokens), vocabulary) and up to ``new_tokens`` tokens, ending at a stop token;
    ``on_token`` sees the tokens chosen so far after each."""
    prompt_logits = model(torch.tensor([tokens]))
    chosen, logits = [], prompt_logits
    for _ in range(new_tokens):
        chosen.append(next_token(logits[0, -1], sampling, generator))
        on_token(chosen)
        if chosen[-1] in stop_ids:
            break
        logits = model(torch.tensor([tokens + chosen]))
    return chosen, prompt_logits


class Stream:
    """Prints the text of the tokens chosen so far as it grows: a piece is printed once its characters are whole
    (a character split over tokens decodes to U+FFFD until its last byte comes)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.printed = decode, ""

    def __call__(self, chosen: list[int]) -> None:
        text = self.decode(chosen)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            print(text[len(self.printed):], end="", flush=True)
            self.printed = text

    def end(self, chosen: list[int]) -> None:
        text = self.decode(chosen)
        print(text[len(self.printed):] if text.startswith(self.printed) else "", flush=True)


def stop_ids(source: Path, eos_id: int) -> set[int]:
    """The end-of-text token and those a Hugging Face folder's generation_config.json ends generation at."""
    config = source / "generation_config.json"
    named = json.loads(config.read_text()).get("eos_token_id") if config.is_file() else None
    return {eos_id, *([] if named is None else [named] if isinstance(named, int) else named)}


def main(argv: list[str] | None = None) -> None:
    """Generate text from a checkpoint or a Hugging Face folder."""
    parser = argparse.ArgumentParser(prog="python -m titan_checkpoint.generate", description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a step-N or weights-step-N checkpoint, or a Hugging Face folder")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--text", help="the prompt")
    prompt.add_argument("--token-ids", help="the prompt as token ids, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=32, help="at most this many tokens are generated")
    parser.add_argument("--adapter", type=Path, help="a PEFT LoRA adapter folder (a lora run's adapter-step-N) to "
                        "fold into the model first")
    parser.add_argument("--chat", action="store_true", help="send the text as a user's turn through the tokenizer's "
                        "chat template")
    parser.add_argument("--chat-template", help="a Jinja chat template file (default: the tokenizer folder's)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default); above: sample")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample among the fewest tokens whose "
                        "probability reaches p")
    parser.add_argument("--seed", type=int, help="the sampling's seed (default: a fresh one each run)")
    parser.add_argument("--logits", type=Path, help="save the prompt's logits to this torch file")
    parser.add_argument("--config", type=Path, help="a checkpoint's run config.yaml (default: two folders up)")
    parser.add_argument("--model-plugin", help="the model plugin building a Hugging Face folder (default: the installed "
                        "one reading its model_type; model.name's values, e.g. one reading any model_type)")
    args = parser.parse_args(argv)
    try:
        check_arguments(args)
        config = job_config(args.model, args.config, args.model_plugin)
        tokenizer = load_tokenizer(config.tokenizer)
        ids = prompt_ids(args, tokenizer, config)
        config.training.seq_len = len(ids) + args.new_tokens  # the rows of the position tables
        model = load_model(args.model, config, args.adapter)
    except ConfigError as error:  # bad input, found before anything is generated: one line, exit 2
        print(f"titan-checkpoint: error: {error}", file=sys.stderr)
        sys.exit(2)
    generator = torch.Generator()
    if args.seed is not None:
        generator.manual_seed(args.seed)
    stream = Stream(tokenizer.decode)
    try:
        chosen, prompt_logits = generate(model, ids, args.new_tokens, stop_ids(args.model, tokenizer.eos_id),
                                         Sampling(args.temperature, args.top_k, args.top_p), generator, stream)
    except KeyboardInterrupt:  # Ctrl-C while tokens stream: what was printed stays, one line says why it ended
        print(f"\ntitan-checkpoint: stopped by SIGINT after {len(stream.printed)} characters", file=sys.stderr)
        sys.exit(130)
    stream.end(chosen)
    if args.logits is not None:
        torch.save(prompt_logits[0], args.logits)


def check_arguments(args) -> None:
    """What the command line alone can tell is wrong, each named with its fix."""
    if not is_hf_folder(args.model) and not (args.model / ".metadata").is_file():
        raise ConfigError("model", f"{args.model} is neither a checkpoint (.metadata) nor a Hugging Face folder "
                          "(config.json)", "give a step-N or weights-step-N folder, or a Hugging Face folder")
    if args.new_tokens < 0:
        raise ConfigError("--new-tokens", f"{args.new_tokens} is negative", "give 0 or more")
    if args.temperature < 0 or not math.isfinite(args.temperature):
        raise ConfigError("--temperature", f"{args.temperature} is not 0 or more", "give 0 (greedy) or above")
    if args.top_k < 0 or not 0 < args.top_p <= 1:
        wrong = "--top-k" if args.top_k < 0 else "--top-p"
        raise ConfigError(wrong, f"{args.top_k if args.top_k < 0 else args.top_p} is out of range",
                          "give --top-k 0 or more, --top-p above 0 and at most 1")
    sampled = [name for name, given in (("--top-k", args.top_k), ("--top-p", args.top_p != 1),
                                         ("--seed", args.seed is not None)) if given]
    if sampled and args.temperature == 0:
        raise ConfigError(sampled[0], "does nothing to greedy generation (temperature 0)",
                          "give --temperature above 0 to sample, or leave it out")
    if args.chat and args.text is None:
        raise ConfigError("--chat", "sends a text as a user's turn, and --token-ids gives none", "give --text")
    if args.text is not None and not args.text.strip():
        raise ConfigError("--text", "is empty: the model would continue from nothing", "give the prompt's text")
    if args.logits is not None and (args.logits.is_dir() or not os.access(args.logits.parent.resolve(), os.W_OK)):
        raise ConfigError("--logits", f"{args.logits} cannot be written", "give a file path in a writable folder")


def prompt_ids(args, tokenizer, config) -> list[int]:
    """The prompt as token ids: ``--token-ids`` as given, the text as a user's turn under the chat template (which
    places any begin-of-text token itself), or the text after the begin-of-text token."""
    if args.chat:
        tokenizer_json = tokenizer_file(config.tokenizer)
        if tokenizer_json is None:
            raise ConfigError("--chat", "the byte-level tokenizer has no chat template",
                              "use a model with a Hugging Face tokenizer, or leave --chat out")
        template, _ = find_chat_template(tokenizer_json, args.chat_template, "--chat-template")
        text = render_chat(template, [{"role": "user", "content": args.text}], config.tokenizer.bos_token or "",
                           config.tokenizer.eos_token or "")
        return tokenizer.encode(text)
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
