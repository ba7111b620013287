"""Chat templates of Hugging Face tokenizer folders: where a folder keeps its template, and the text a conversation
renders to under it, as transformers renders it (a sandboxed Jinja environment with the same filters and globals),
for the plugins' commands that do without transformers."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from titan_core.errors import ConfigError


def find_chat_template(tokenizer_json: Path, chat_template: str | None, field: str) -> tuple[str, str]:
    """The template's text and where it was found: the file ``chat_template`` names, else the one saved beside
    the tokenizer (``chat_template.jinja``, or ``tokenizer_config.json``'s ``chat_template``)."""
    if chat_template is not None:
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise ConfigError(field, f"{path} is not a file", "point it at a Jinja chat template (.jinja)")
        return path.read_text(), str(path)
    folder = tokenizer_json.parent
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(), str(folder / "chat_template.jinja")
    saved = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template") if (
        folder / "tokenizer_config.json").is_file() else None
    if isinstance(saved, list):  # several named templates: the default one
        saved = next((t["template"] for t in saved if t.get("name") == "default"), None)
    if not saved:
        raise ConfigError(field, f"the tokenizer in {folder} has no chat template (neither tokenizer_config.json's "
                          "chat_template nor chat_template.jinja)", "set it to a Jinja chat template file")
    return saved, f"{folder / 'tokenizer_config.json'}'s chat_template"


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``, which marks the assistant's tokens for training: its body as is."""

    tags = {"generation"}

    def parse(self, parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render_chat(template: str, messages: list[dict], bos_token: str, eos_token: str,
                add_generation_prompt: bool = True) -> str:
    """The text ``messages`` render to under ``template``, ending with the assistant's turn opened when
    ``add_generation_prompt`` (transformers' ``apply_chat_template(tokenize=False)``)."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols, _Generation])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception,
                               strftime_now=lambda format: datetime.now().strftime(format))
    return environment.from_string(template).render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                                    add_generation_prompt=add_generation_prompt)
