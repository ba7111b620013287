"""Tokenizers, document formats and the packed loader: sharding and exact resume."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from titan_core.data import document_opener, load_tokenizer
from titan_core.data.text import PackedLoader
from titan_core.data.tokenizer import ByteTokenizer

DOCS = [f"document number {i} " + "word " * (i % 7) for i in range(40)]


def data_config(**values):
    return OmegaConf.create({"source": "local", "path": None, "name": None, "split": "train", "text_field": "text",
                             **values})


def test_builtin_tokenizer_round_trip():
    tokenizer = load_tokenizer(OmegaConf.create({"path": "builtin", "bos_token": "<|begin_of_text|>",
                                                 "eos_token": "<|end_of_text|>"}))
    assert tokenizer.vocab_size == 2048
    text = "Return the list of arguments, in order."
    ids = tokenizer.encode(text)
    assert len(ids) < len(text) / 2  # merges, not bytes
    assert tokenizer.decode(ids) == text
    assert {tokenizer.bos_id, tokenizer.eos_id}.isdisjoint(ids)


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "txt"])
def test_local_formats(tmp_path, fmt):
    path = tmp_path / f"docs.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": DOCS}), path)
    else:
        path.write_text("\n".join(DOCS) + "\n")
    assert list(document_opener(data_config(path=str(path)))()) == DOCS


def test_builtin_corpus_is_real_text():
    docs = list(document_opener(data_config(source="builtin"))())
    assert len(docs) > 1000 and sum(map(len, docs)) > 500_000


def loader(dp_rank=0, dp_size=1, batch=4, seq_len=16):
    return PackedLoader(lambda: iter(DOCS), ByteTokenizer(), seq_len, batch, dp_rank, dp_size)


def test_packing_puts_documents_between_bos_and_eos():
    inputs, labels = next(loader(batch=1, seq_len=64))
    tokenizer = ByteTokenizer()
    assert inputs[0, 0] == tokenizer.bos_id
    first = tokenizer.encode(DOCS[0])
    assert inputs[0, 1:1 + len(first)].tolist() == first
    assert inputs[0, 1 + len(first)] == tokenizer.eos_id
    torch.testing.assert_close(inputs[0, 1:], labels[0, :-1])


def test_data_parallel_ranks_split_the_global_batch():
    single = loader()
    whole = [next(single) for _ in range(3)]
    ranks = [loader(dp_rank=r, dp_size=2) for r in range(2)]
    for inputs, labels in whole:
        parts = [next(r) for r in ranks]
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), inputs)
        torch.testing.assert_close(torch.cat([p[1] for p in parts]), labels)


def test_resume_continues_the_stream_across_epochs_and_degrees():
    reference = loader()
    expected = [next(reference) for _ in range(30)]  # 30 x 4 x 17 tokens is more than one epoch
    assert reference.epoch >= 1
    first = loader()
    for _ in range(12):
        next(first)
    state = first.state_dict()
    # Resume at another data-parallel degree: the two halves make up the same global batches.
    resumed = [loader(dp_rank=r, dp_size=2) for r in range(2)]
    for r in resumed:
        r.load_state_dict(state)
    for inputs, _ in expected[12:]:
        torch.testing.assert_close(torch.cat([next(r)[0] for r in resumed]), inputs)


def test_an_unreachable_hub_dataset_is_one_line_before_launch(monkeypatch):
    """Offline (as in CI), or a wrong name: the Hub client's error becomes one line naming data.path."""
    from titan_core.data import check_documents
    from titan_core.errors import ConfigError

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as error:
        check_documents(data_config(source="hub", path="nosuch/dataset"))
    message = str(error.value)
    assert message.startswith("data.path: the Hub dataset 'nosuch/dataset' cannot be opened (") and \
        "data.source=local" in message, message
