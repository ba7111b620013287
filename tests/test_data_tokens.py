"""Prepared token shards: prepare (parallel, resumable, refusing what it cannot keep), the global sample
index (each rank reads only its rows, O(1) resume at any degree), shuffling, mixtures, prefetch, and the
text stream's own resume."""

import dataclasses
import json
import logging
import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from titan_core.data import Prefetcher, document_opener, load_tokenizer
from titan_core.data.prepare import main as prepare_main
from titan_core.data.text import PackedLoader, TextStream
from titan_core.data.tokens import Mixture, Samples, TokenLoader, TokenShards, permuted
from titan_core.testing import TINY, error_line, run_job

BYTES = OmegaConf.create({"path": "bytes", "bos_token": "", "eos_token": ""})
BUILTIN = OmegaConf.create({"source": "builtin", "path": None, "name": None, "split": "train", "text_field": "text"})
SEQ = 32


def text_loader(dp_rank=0, dp_size=1, batch=8, data=BUILTIN, keep=None):
    return PackedLoader(document_opener(data), load_tokenizer(BYTES), SEQ, batch, dp_rank, dp_size, keep)


def token_loader(folder, dp_rank=0, dp_size=1, batch=8, every=0, held=False, seed=None):
    return TokenLoader([Samples(TokenShards(str(folder), "data.path"), SEQ + 1, every, held, seed)], ["builtin"],
                       [1.0], batch, dp_rank, dp_size)


class CountingShards(TokenShards):
    """Counts the tokens read from disk."""

    read_tokens = 0

    def read(self, start, length):
        CountingShards.read_tokens += length
        return super().read(start, length)


def test_prepare_writes_every_document_once_with_its_tokenizer(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    documents = [d for d in document_opener(BUILTIN)() if d]
    tokenizer = load_tokenizer(BYTES)
    assert manifest["documents"] == len(documents) and len(manifest["shards"]) == 3
    assert manifest["tokenizer"]["sha256"] == "bytes" and manifest["dtype"] == "uint16"
    stream = np.concatenate([np.fromfile(prepared / f"tokens-{i:05d}.bin", dtype=np.uint16) for i in range(3)])
    expected = [t for d in documents for t in [tokenizer.bos_id, *tokenizer.encode(d), tokenizer.eos_id]]
    assert stream.tolist() == expected
    starts = np.load(prepared / "documents-00001.npy")
    assert len(starts) == 500 and stream[manifest["shards"][0]["tokens"] + starts[7]] == tokenizer.bos_id


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_each_rank_reads_its_rows_of_the_text_loaders_batches(prepared, dp_size):
    """Within an epoch the shards' samples are the text loader's; a rank reads only its rows' tokens."""
    reference = text_loader()
    batches = [next(reference) for _ in range(20)]
    for rank in range(dp_size):
        loader = TokenLoader([Samples(CountingShards(str(prepared), "data.path"), SEQ + 1)], ["builtin"], [1.0], 8,
                             rank, dp_size)
        CountingShards.read_tokens = 0
        rows = slice(rank * 8 // dp_size, (rank + 1) * 8 // dp_size)
        for inputs, labels in batches:
            mine = next(loader)
            assert torch.equal(mine[0], inputs[rows]) and torch.equal(mine[1], labels[rows])
        assert CountingShards.read_tokens == 20 * (8 // dp_size) * (SEQ + 1)


def test_resume_reads_nothing_and_continues_at_any_degree(prepared):
    """The position is a sample number: a loader resumed far into the run (epochs in) at another degree
    reads only the rows it returns, and they continue the uninterrupted stream."""
    reference = token_loader(prepared, seed=5)
    per_epoch = reference.sources[0].per_epoch
    reference.load_state_dict({"sample": 3 * per_epoch - 16})  # two batches before the fourth epoch
    expected = [next(reference)[0] for _ in range(4)]
    halves = [TokenLoader([Samples(CountingShards(str(prepared), "data.path"), SEQ + 1, 0, False, 5)], ["builtin"],
                          [1.0], 8, r, 2) for r in range(2)]
    CountingShards.read_tokens = 0
    for half in halves:
        half.load_state_dict({"sample": 3 * per_epoch - 16})
    assert CountingShards.read_tokens == 0
    for inputs in expected:
        assert torch.equal(torch.cat([next(h)[0] for h in halves]), inputs)
    assert CountingShards.read_tokens == 4 * 8 * (SEQ + 1)


def test_the_shuffle_is_a_new_permutation_each_epoch():
    for size in (1, 2, 5, 1000, 4099):
        assert sorted(permuted(i, size, 7) for i in range(size)) == list(range(size))
    first, second = ([permuted(i, 1000, key) for i in range(1000)] for key in (1, 2))
    assert first != second and sum(a == b for a, b in zip(first, second)) < 20
    assert sum(abs(a - i) for i, a in enumerate(first)) > 1000 * 200  # far from the stored order


def test_shuffled_epochs_each_see_every_sample_once(prepared):
    samples = Samples(TokenShards(str(prepared), "data.path"), SEQ + 1, seed=3)
    n = samples.per_epoch
    epochs = [[samples.slot(e * n + i) for i in range(n)] for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(n)) and epochs[0] != epochs[1]
    assert Samples(TokenShards(str(prepared), "data.path"), SEQ + 1, seed=4).slot(0) != epochs[0][0] or \
        Samples(TokenShards(str(prepared), "data.path"), SEQ + 1, seed=4).slot(1) != epochs[0][1]


def test_held_out_samples_are_never_trained_on(prepared):
    shards = TokenShards(str(prepared), "data.path")
    kept, held = Samples(shards, SEQ + 1, 10, False, seed=1), Samples(shards, SEQ + 1, 10, True)
    slots = shards.tokens // (SEQ + 1)
    trained = {kept.slot(i) for i in range(2 * kept.per_epoch)}
    validated = {held.slot(i) for i in range(held.per_epoch)}
    assert trained.isdisjoint(validated) and trained | validated == set(range(slots))
    assert validated == set(range(0, slots, 10))


def test_a_mixture_keeps_its_shares_in_every_window():
    mixture = Mixture([0.6, 0.3, 0.1])
    counts = np.zeros(3)
    for sample in range(2000):
        source, index = mixture.locate(sample)
        assert index == counts[source]  # each source's samples in order, none skipped or repeated
        counts[source] += 1
        assert np.all(np.abs(counts - np.array([0.6, 0.3, 0.1]) * (sample + 1)) <= 1.0)
        assert mixture.taken(sample + 1).tolist() == counts.tolist()
    assert mixture.locate(123_456_789)[1] == mixture.taken(123_456_789)[mixture.locate(123_456_789)[0]]


def test_a_small_source_repeats_and_the_log_says_so(prepared, tmp_path, caplog):
    small = tmp_path / "small"
    prepare_main([str(small), "tokenizer.path=bytes", "data.source=local", f"data.path={write_docs(tmp_path, 30)}",
                  "--workers", "1"])
    shards = [TokenShards(str(prepared), "data.path"), TokenShards(str(small), "data.path")]
    loader = TokenLoader([Samples(s, SEQ + 1) for s in shards], ["builtin", "small"], [3.0, 1.0], 8, 0, 1)
    small_per_epoch = loader.sources[1].per_epoch
    assert "repeats" in loader.describe(small_per_epoch)[1] and "repeats" not in loader.describe(10)[1]
    with caplog.at_level(logging.INFO, logger="titan_core"):
        for _ in range(small_per_epoch):  # 8 samples a batch, 2 of them the small source's
            next(loader)
    assert "data: small starts its epoch 2: its" in caplog.text and "builtin starts" not in caplog.text
    assert loader.metrics() == {"tokens_builtin": 6 * small_per_epoch * SEQ, "tokens_small": 2 * small_per_epoch * SEQ}


def write_docs(folder, count):
    path = folder / f"docs{count}.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}: " + "some words here " * (i % 5 + 3)}) + "\n"
                            for i in range(count)))
    return path


def test_prefetch_gives_the_same_batches_and_saves_the_position_taken(prepared):
    alone = token_loader(prepared)
    expected = [next(alone) for _ in range(6)]
    ahead = Prefetcher(token_loader(prepared), depth=2)
    for inputs, labels in expected[:3]:
        got = next(ahead)
        assert torch.equal(got[0], inputs) and torch.equal(got[1], labels)
    assert ahead.state_dict() == {"sample": 24}  # three batches taken, whatever was made ahead
    resumed = Prefetcher(token_loader(prepared), depth=2)
    resumed.load_state_dict(ahead.state_dict())
    for inputs, _ in expected[3:]:
        assert torch.equal(next(resumed)[0], inputs) and torch.equal(next(ahead)[0], inputs)
    ahead.close()
    resumed.close()


def test_a_failing_loader_fails_the_step_that_takes_its_batch():
    class Broken:
        def __next__(self):
            raise OSError("disk gone")

        def state_dict(self):
            return {}

    with pytest.raises(OSError, match="disk gone"):
        next(Prefetcher(Broken(), depth=1))


def test_the_text_stream_resumes_from_its_saved_position(tmp_path, monkeypatch):
    """datasets' own position: the resumed stream starts at the next document instead of reading the ones
    before it again."""
    data = OmegaConf.merge(BUILTIN, {"source": "local", "path": str(write_docs(tmp_path, 400))})
    reference = text_loader(data=data, batch=2)
    expected = [next(reference)[0] for _ in range(12)]
    first = text_loader(data=data, batch=2)
    for _ in range(6):
        next(first)
    state = first.state_dict()
    read = []
    original = TextStream.__iter__
    monkeypatch.setattr(TextStream, "__iter__", lambda self: (read.append(1) or text for text in original(self)))
    resumed = text_loader(data=data, batch=2)
    resumed.load_state_dict(state)
    for inputs in expected[6:]:
        assert torch.equal(next(resumed)[0], inputs)
    assert len(read) == resumed.documents_read - state["documents_read"]  # none before the saved position


def test_a_loaded_position_is_the_position_until_more_is_read(tmp_path):
    """A loader that has read, then loads another position (a recovering ft group, a resume), reports the loaded
    position, not its own stream's old one, even before it reads again."""
    data = OmegaConf.merge(BUILTIN, {"source": "local", "path": str(write_docs(tmp_path, 400))})
    ahead, behind = text_loader(data=data, batch=2), text_loader(data=data, batch=2)
    for _ in range(40):
        next(ahead)
    next(behind)
    assert behind.documents_read < ahead.documents_read
    behind.load_state_dict(ahead.state_dict())
    for name, value in ahead.state_dict().items():
        assert torch.equal(torch.as_tensor(behind.state_dict()[name]), torch.as_tensor(value)), name


# Before launch: one line naming the field, for each fault of prepared data.
def test_shards_of_another_tokenizer_are_refused(prepared, tmp_path):
    line = error_line(run_job([*TINY, "tokenizer.path=builtin", "data.source=tokens", f"data.path={prepared}"],
                              tmp_path / "run", expect_success=False))
    assert "data.path: " in line and "prepared with another tokenizer" in line and "fix: set tokenizer" in line


def test_a_truncated_shard_is_refused_and_preparing_again_mends_it(prepared, tmp_path):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(prepared, folder)
    tokens = folder / "tokens-00001.bin"
    tokens.write_bytes(tokens.read_bytes()[:-10])
    (folder / "shard-00001.json").unlink()  # what a crash in the middle of writing it leaves
    line = error_line(run_job([*TINY, "data.source=tokens", f"data.path={folder}"], tmp_path / "run",
                              expect_success=False))
    assert "data.path: " in line and "tokens-00001.bin holds" in line and "truncated" in line
    prepare_main([str(folder), "tokenizer.path=bytes", "--workers", "1", "--documents-per-shard", "500"])
    assert tokens.read_bytes() == (prepared / "tokens-00001.bin").read_bytes()


@pytest.mark.parametrize("overrides, field, words", [
    (["data.mixture=[{path:PREPARED,weight:0}]"], "data.mixture[0].weight", "is not a positive number"),
    (["data.mixture=[{path:PREPARED,weight:1},{path:/nonexistent/tokens,weight:1}]"], "data.mixture[1].path",
     "holds no manifest.json"),
    (["data.path=PREPARED", "data.mixture=[{path:PREPARED,weight:1}]"], "data.path", "together with data.mixture"),
    (["data.path=/nonexistent/tokens"], "data.path", "holds no manifest.json"),
    (["data.mixture=[{path:PREPARED,weight:1},{path:PREPARED,weight:2}]"], "data.mixture", "the same name"),
])
def test_a_bad_tokens_source_is_one_line_before_launch(prepared, tmp_path, overrides, field, words):
    overrides = [o.replace("PREPARED", str(prepared)) for o in overrides]
    line = error_line(run_job([*TINY, "data.source=tokens", *overrides], tmp_path / "run", expect_success=False))
    assert line.startswith(f"titan-core: error: {field}: ") and words in line, line


def test_an_interrupted_prepare_resumes_and_keeps_what_it_wrote(tmp_path, monkeypatch):
    from titan_core.data.tokenizer import ByteTokenizer

    docs = write_docs(tmp_path, 90)
    argv = [str(tmp_path / "out"), "tokenizer.path=bytes", "data.source=local", f"data.path={docs}", "--workers", "1",
            "--documents-per-shard", "30"]
    calls = []
    original = ByteTokenizer.encode_batch

    def fail_on_the_third_shard(self, texts):
        calls.append(len(texts))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, texts)

    monkeypatch.setattr(ByteTokenizer, "encode_batch", fail_on_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare_main(argv)
    out = tmp_path / "out"
    assert not (out / "manifest.json").exists() and (out / "shard-00001.json").exists()
    written = {f.name: os.stat(f).st_mtime_ns for f in out.glob("tokens-*.bin")}
    prepare_main(argv)
    assert len(calls) == 4  # the third shard again, not the first two
    assert {f: os.stat(out / f).st_mtime_ns for f in written} == written
    whole = tmp_path / "whole"
    monkeypatch.setattr(ByteTokenizer, "encode_batch", original)
    prepare_main([str(whole), *argv[1:]])
    for name in ("tokens-00000.bin", "tokens-00001.bin", "tokens-00002.bin", "manifest.json"):
        assert (out / name).read_bytes() == (whole / name).read_bytes()


def test_prepare_refuses_other_input_into_a_prepared_folder(prepared, tmp_path, capsys):
    before = (prepared / "manifest.json").read_bytes()
    with pytest.raises(SystemExit) as exit_:
        prepare_main([str(prepared), "tokenizer.path=builtin"])
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("titan-core: error: output: ") and "holds a preparation of other" in line
    assert (prepared / "manifest.json").read_bytes() == before


@pytest.mark.slow
def test_a_sharded_mixture_trains_validates_and_resumes_like_one_process(prepared, tmp_path):
    """fsdp 2 on a shuffled mixture with validation held out of it: the losses of one process; and a run
    stopped at step 3 and resumed by one process ends with the uninterrupted run's weights."""
    from titan_core.testing import compare

    small = tmp_path / "small"
    prepare_main([str(small), "tokenizer.path=bytes", "data.source=local", f"data.path={write_docs(tmp_path, 60)}",
                  "--workers", "1"])
    data = ["data.source=tokens", f"data.mixture=[{{path:{prepared},weight:3}},{{path:{small},weight:1}}]",
            "data.shuffle=true", "validation.every=2", "validation.batches=1", "validation.holdout_every=5"]
    single = run_job([*TINY, *data, "training.steps=6"], tmp_path / "single")
    sharded = run_job([*TINY, *data, "training.steps=6", "+plugins=[fsdp,checkpoint]", "plugins.fsdp.degree=2",
                       "plugins.checkpoint.interval=3"], tmp_path / "sharded")
    report = compare(sharded, single)
    assert report.max_loss_diff < 1e-5 and report.max_param_diff < 1e-5, report
    logged = [m for m in sharded.metrics if "validation_loss" in m]
    assert [m["step"] for m in logged] == [2, 4, 6]
    assert sharded.metrics[-1]["tokens_small"] == 6 * 2 * SEQ and sharded.metrics[-1]["tokens_builtin"] == 6 * 6 * SEQ
    resumed = run_job([*TINY, *data, "training.steps=6", "+plugins=[checkpoint]",
                       f"plugins.checkpoint.load_path={sharded.run_dir / 'checkpoints' / 'step-3'}"], tmp_path / "resumed")
    assert [m["step"] for m in resumed.metrics] == [4, 5, 6]
    report = compare(resumed, dataclasses.replace(single, after_step=3))
    assert report.max_loss_diff < 1e-5 and report.max_param_diff < 1e-5, report
