"""Regenerate titan_core/assets/: the built-in training corpus and the tokenizer trained on it.

The default run must train on real text without any download, so the corpus is the English prose of
the CPython standard library's docstrings (PSF licence): one document per module, class or function
docstring of at least 200 characters, in a fixed order so that every regeneration on the same Python
gives the same file.

The tokenizer is a byte-level BPE with 2048 entries trained on that corpus. (The 2048-entry tokenizer in
shared/assets stores its vocabulary as raw strings without merges, so HF `tokenizers` drops every space.)
"""
import gzip
import importlib
import inspect
import json
import pkgutil
import sys
import warnings
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]

SKIP_PREFIXES = ("test", "idlelib", "tkinter", "turtle", "lib2to3", "ensurepip", "__", "antigravity", "this")


def docstrings():
    seen = set()
    for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        if info.name.startswith(SKIP_PREFIXES) or info.name not in sys.stdlib_module_names:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(info.name)
        except Exception:
            continue
        objects = [module] + [obj for _, obj in sorted(vars(module).items(), key=lambda kv: kv[0])
                              if inspect.isclass(obj) or inspect.isfunction(obj)]
        for obj in objects:
            for candidate in [obj] + ([v for _, v in sorted(vars(obj).items(), key=lambda kv: kv[0])
                                        if inspect.isfunction(v)] if inspect.isclass(obj) else []):
                doc = inspect.getdoc(candidate)
                if doc and len(doc) >= 200 and doc not in seen:
                    seen.add(doc)
                    yield doc


def train_tokenizer(documents, vocab_size=2048):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def main():
    assets = Path(__file__).resolve().parent.parent / "titan_core" / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    documents = list(docstrings())
    corpus = assets / "corpus.jsonl.gz"
    with gzip.GzipFile(corpus, "wb", mtime=0) as raw:
        for doc in documents:
            raw.write((json.dumps({"text": doc}) + "\n").encode())
    print(f"{corpus}: {len(documents)} documents, {corpus.stat().st_size / 1e6:.2f} MB compressed")
    tokenizer = train_tokenizer(documents)
    tokenizer.save(str(assets / "tokenizer.json"))
    print(f"tokenizer: {tokenizer.get_vocab_size()} entries")


if __name__ == "__main__":
    main()
