from pathlib import Path

import pytest

from titan_core.data.prepare import main as prepare_main
from titan_core.testing import install_plugins


@pytest.fixture
def fake_plugins(tmp_path):
    """``fake_plugins({name: (declaration, yaml_body)})`` installs plugins whose ``declare`` returns
    ``declaration`` (Python source) and returns the environment for a ``titan_core.run`` subprocess."""

    def install(plugins: dict, distribution: str = "fake-plugins") -> dict:
        sources = {name: (f"from titan_core import Declaration, hookimpl\n\n@hookimpl\n"
                          f"def declare(plugin_config):\n    return {declaration}\n", options)
                   for name, (declaration, options) in plugins.items()}
        return install_plugins(tmp_path / "site", sources, distribution)
    return install


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    """The shipped corpus in byte tokens, three shards, tokenized by two processes (read only: copy to damage)."""
    folder = tmp_path_factory.mktemp("tokens") / "builtin"
    prepare_main([str(folder), "tokenizer.path=bytes", "--workers", "2", "--documents-per-shard", "500"])
    return folder


@pytest.fixture
def data_dir(tmp_path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path
