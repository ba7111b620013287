"""Chat fine-tuning: rendering like transformers, the replies alone trained, every plan equal to one process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from titan_core import IGNORE_INDEX, document_ids, load_tokenizer, tokenizer_file
from titan_core.testing import (LOSS_TOL, PARAM_TOL, TINY, built_model, compare, config_error, error_line, merged,
                                run_job)
from titan_sft.chat import ChatRenderer
from titan_sft.rows import ChatRows

transformers = pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data"
CHAT = DATA / "chat.jsonl"
CONVERSATIONS = [json.loads(line)["messages"] for line in CHAT.read_text().splitlines()]
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SEQ_LEN = 256
BOS_ID, EOS_ID = (lambda t: (t.bos_id, t.eos_id))(load_tokenizer(OmegaConf.create({"path": "builtin", "bos_token": BOS,
                                                                                  "eos_token": EOS})))


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    """The shipped tokenizer with a ChatML template saved beside it, as transformers saves one."""
    folder = tmp_path_factory.mktemp("tokenizer")
    shutil.copyfile(tokenizer_file(OmegaConf.create({"path": "builtin"})), folder / "tokenizer.json")
    shutil.copyfile(DATA / "chatml.jinja", folder / "chat_template.jinja")
    return folder


def _renderer(folder: Path) -> ChatRenderer:
    return ChatRenderer(folder / "tokenizer.json", (folder / "chat_template.jinja").read_text(), BOS, EOS,
                        bos_id=BOS_ID, max_tokens=SEQ_LEN + 1)


def test_a_conversation_renders_as_transformers_renders_it_and_only_replies_train(tokenizer_folder):
    renderer = _renderer(tokenizer_folder)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_folder / "tokenizer.json"))
    theirs.chat_template = (tokenizer_folder / "chat_template.jinja").read_text()
    for messages in CONVERSATIONS[:12]:
        example = renderer.example(messages)
        ids = theirs.apply_chat_template(messages, tokenize=False)
        assert list(example.ids) == [BOS_ID, *theirs(ids, add_special_tokens=False)["input_ids"]]
        trained = renderer.tokenizer.decode([t for t, keep in zip(example.ids, example.trained) if keep])
        assert trained == "".join(f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant")


@pytest.mark.parametrize("messages, problem", [
    ([{"role": "user", "content": "Hello?"}], "no assistant turn"),
    ([{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Beep."}], "unknown role 'robot'"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "word " * 400}], "tokens, more than a row's 257"),
    ("not a list", "not a list of {role, content} messages"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "4"}], "not a list of {role, content}"),
])
def test_a_conversation_that_cannot_train_says_why(tokenizer_folder, messages, problem):
    assert problem in _renderer(tokenizer_folder).example(messages).problem


def test_a_conversation_that_document_attention_would_cut_is_refused(tokenizer_folder):
    # A Qwen instruct folder has no begin token and ends each turn with its end-of-text token, which then starts
    # documents: its replies would not see the question.
    end_of_turn = ChatRenderer(tokenizer_folder / "tokenizer.json", "{% for m in messages %}{{ m.content }}"
                               "<|end_of_text|>{% endfor %}", BOS, EOS, EOS_ID, SEQ_LEN + 1)
    assert "appears inside it" in end_of_turn.example(CONVERSATIONS[1]).problem


def test_a_template_that_rewrites_earlier_turns_is_refused_not_trained_wrongly(tokenizer_folder, tmp_path):
    # Like templates that drop an earlier reply's reasoning once a later turn follows.
    template = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[reply]{% else %}"
                "{{ m.role }}: {{ m.content }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    renderer = ChatRenderer(tokenizer_folder / "tokenizer.json", template, BOS, EOS, 0, SEQ_LEN + 1)
    two_turns = next(m for m in CONVERSATIONS if sum(t["role"] == "assistant" for t in m) == 2)
    assert "renders an earlier turn differently" in renderer.example(two_turns).problem


def sft_job(folder: Path, *plugins: str) -> list[str]:
    return merged(TINY, [f"tokenizer.path={folder}", f"training.seq_len={SEQ_LEN}",
                         "training.attention_mask=block_causal", f"+plugins=[{','.join(['sft', *plugins])}]",
                         f"plugins.sft.path={CHAT}"])


@pytest.fixture(scope="module")
def one_process(tokenizer_folder, tmp_path_factory):
    return run_job(sft_job(tokenizer_folder), tmp_path_factory.mktemp("sft-one"))


def test_uneven_replies_make_a_per_rank_mean_differ_from_the_step_loss(tokenizer_folder, one_process):
    # What the parity below guards against: the first step's loss, as one process computes it on the global
    # batch, against the mean of the two halves' means (two data-parallel ranks, or two micro-batches).
    rows = ChatRows(lambda i: _renderer(tokenizer_folder).example(CONVERSATIONS[i]), range(len(CONVERSATIONS)),
                    8, range(8), SEQ_LEN, EOS_ID, packing=True)
    inputs, labels = next(rows)
    trained = (labels != IGNORE_INDEX).sum(dim=1)
    assert trained.min() * 3 < trained.max()  # replies fall unevenly on the rows
    model = built_model(f"tokenizer.path={tokenizer_folder}", "model=tiny", f"training.seq_len={SEQ_LEN}")
    with torch.no_grad():
        logits = model(inputs, document_ids=document_ids(inputs, BOS_ID))  # packed: each attends to its own
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(8, -1)
    step_loss = losses.sum() / trained.sum()
    halves = (losses[:4].sum() / trained[:4].sum() + losses[4:].sum() / trained[4:].sum()) / 2
    assert one_process.losses[0] == pytest.approx(step_loss.item(), abs=LOSS_TOL)
    assert abs(halves - step_loss) > 30 * LOSS_TOL


@pytest.mark.parametrize("plan", [
    ("fsdp", "plugins.fsdp.degree=2"),
    ("fsdp", "plugins.fsdp.degree=2", "training.grad_accum_steps=2"),
    ("tp", "plugins.tp.degree=2"),
    ("cp", "plugins.cp.degree=2"),
    ("pp", "plugins.pp.degree=2", "plugins.pp.microbatches=2"),
    ("chunked_loss", "plugins.chunked_loss.chunk_tokens=100", "training.grad_accum_steps=4"),
], ids=["fsdp2", "fsdp2-accum2", "tp2", "cp2", "pp2-mb2", "chunked-accum4"])
def test_every_plan_trains_on_the_replies_like_one_process(tokenizer_folder, one_process, tmp_path, plan):
    plugin, *options = plan
    result = run_job([*sft_job(tokenizer_folder, plugin), *options], tmp_path)
    report = compare(result, one_process)
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report


def test_the_planner_counts_chat_fine_tuning_as_the_cores_rows_and_masks(tokenizer_folder):
    def planned(*overrides):
        done = subprocess.run([sys.executable, "-m", "titan_core.planner", "--hardware", "h100", *overrides],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.split("titan-core estimate: ")[1].splitlines()  # the figures, after the plan's lines

    job = sft_job(tokenizer_folder)
    chat, plain = planned(*job), planned(*(o for o in job if "sft" not in o))
    assert not any("not counted" in line for line in chat)
    assert chat == plain  # the same memory, step and collectives: packed rows' masks are the core's, traced


def test_rows_resume_where_they_stopped_and_hold_whole_conversations(tokenizer_folder):
    renderer = _renderer(tokenizer_folder)
    def rows():
        return ChatRows(lambda i: renderer.example(CONVERSATIONS[i]), range(len(CONVERSATIONS)), 8, range(4, 8),
                        SEQ_LEN, EOS_ID, packing=True)
    first = rows()
    for _ in range(5):  # past the end of some rows' streams: they wrap around
        next(first)
    resumed = rows()
    resumed.load_state_dict(first.state_dict())
    for _ in range(3):
        (inputs, labels), (expected_inputs, expected_labels) = next(resumed), next(first)
        assert torch.equal(inputs, expected_inputs) and torch.equal(labels, expected_labels)
    starts = (inputs == BOS_ID).sum(dim=1)
    assert starts.min() >= 1 and starts.max() >= 2  # each row starts a conversation; some hold two or more


def test_held_out_conversations_validate_like_one_process(tokenizer_folder, tmp_path):
    validating = ["plugins.sft.holdout_every=8", "validation.every=2", "validation.batches=1", "training.steps=2"]
    one = run_job([*sft_job(tokenizer_folder), *validating], tmp_path / "one")
    sharded = run_job([*sft_job(tokenizer_folder, "fsdp"), "plugins.fsdp.degree=2", *validating], tmp_path / "fsdp")
    losses = [m["validation_loss"] for m in one.metrics if "validation_loss" in m]
    assert len(losses) == 1 and losses == pytest.approx(
        [m["validation_loss"] for m in sharded.metrics if "validation_loss" in m], abs=LOSS_TOL)
    assert abs(losses[0] - one.losses[-1]) > 1e-3  # other conversations than the trained ones


def test_bad_rows_are_counted_before_launch_or_refused(tokenizer_folder, tmp_path):
    bad = f"plugins.sft.path={DATA / 'bad_chat.jsonl'}"
    counted = run_job([*sft_job(tokenizer_folder), bad, "training.steps=1"], tmp_path / "counted")
    assert ("titan-sft: 3 of 15 conversations left out: 1 no assistant turn (e.g. row 12); 1 unknown role (e.g. row "
            "13); 1 longer than a row (e.g. row 14)") in counted.stdout
    refused = run_job([*sft_job(tokenizer_folder), bad, "plugins.sft.bad_rows=stop"], tmp_path / "refused",
                      expect_success=False)
    assert error_line(refused) == (
        "titan-core: error: plugins.sft.path: conversation 12 cannot be trained on: no assistant turn (3 of 15 cannot); "
        "fix: fix or drop those rows, or set plugins.sft.bad_rows=skip")


def test_too_few_held_out_conversations_for_a_batch_are_refused(tokenizer_folder):
    error = config_error(*sft_job(tokenizer_folder), "plugins.sft.holdout_every=16", "validation.every=2")
    assert error.field == "plugins.sft.holdout_every" and "holds out 4 usable conversations" in str(error)


def test_a_conversation_file_cut_short_is_named_with_its_line_or_skipped_and_counted(tokenizer_folder, tmp_path):
    """A .jsonl copy cut in its last line (was 83 lines and three tracebacks from the datasets library): under
    bad_rows=stop one line naming the file and the line, before launch; under skip the line is left out and counted
    like any bad row, and every whole line is a row, in the files' order."""
    from titan_sft.plugin import _rows

    whole = CHAT.read_text()
    folder = tmp_path / "conversations"
    folder.mkdir()
    cut, after = folder / "a.jsonl", folder / "b.jsonl"
    cut.write_text(whole + whole.splitlines()[0][:25])
    after.write_text("\n".join(whole.splitlines()[:3]) + "\n")
    lines = len(whole.splitlines()) + 1
    error = config_error(*sft_job(tokenizer_folder), f"plugins.sft.path={cut}", "plugins.sft.bad_rows=stop")
    assert str(error) == (f"plugins.sft.path: {cut} line {lines} is not whole JSON (the file was cut short?); fix: "
                          "copy the file again, remove the line, or set plugins.sft.bad_rows=skip to train without it")
    options = OmegaConf.create({"path": str(folder), "bad_rows": "skip", "name": None, "split": "train"})
    rows, left_out = _rows(options)
    assert left_out == [f"{cut} line {lines}"]
    expected = [json.loads(line) for line in [*whole.splitlines(), *whole.splitlines()[:3]]]
    assert rows.to_list() == expected
    counted = run_job([*sft_job(tokenizer_folder), f"plugins.sft.path={folder}", "training.steps=1"], tmp_path / "run")
    assert f"titan-sft: 1 of {lines + 3} conversations left out: 1 cut short (e.g. {cut} line {lines})" in counted.stdout


@pytest.mark.parametrize("bad_rows", ["skip", "stop"])
def test_a_chat_template_that_is_not_valid_jinja_is_named_with_its_error(tokenizer_folder, tmp_path, bad_rows):
    """A template with a Jinja syntax error renders no row: named with its line and Jinja's words (it was reported as
    "0 usable conversations, fewer than the rows of a batch" under skip, or as the first row's problem under stop)."""
    template = tmp_path / "broken.jinja"
    template.write_text("{% for message in messages %}\n{{ message.content }}\n{% endfor")
    error = config_error(*sft_job(tokenizer_folder), f"plugins.sft.chat_template={template}",
                         f"plugins.sft.bad_rows={bad_rows}")
    assert str(error) == (f"plugins.sft.chat_template: {template} is not valid Jinja: line 3: unexpected end of "
                          "template, expected 'end of statement block'.; fix: correct the template, or point "
                          "plugins.sft.chat_template at another")
    saved = tmp_path / "saved"
    shutil.copytree(tokenizer_folder, saved)
    (saved / "chat_template.jinja").write_text("{{ messages[0].content }")
    error = config_error(*sft_job(saved))
    assert str(error).startswith(f"plugins.sft.chat_template: {saved / 'chat_template.jinja'} is not valid Jinja: "
                                 "line 1: ")


def test_a_hub_datasets_split_set_for_a_local_file_is_refused(tokenizer_folder):
    """name and split choose among a hub dataset's; beside a local file they did nothing, silently."""
    error = config_error(*sft_job(tokenizer_folder), "plugins.sft.split=test")
    assert str(error) == ("plugins.sft.split: test does nothing unless plugins.sft.path=<a hub dataset>; fix: set "
                          "plugins.sft.path=<a hub dataset>, or leave plugins.sft.split at its default (train)")
