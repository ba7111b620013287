import os
import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def fake_plugins(tmp_path):
    """``fake_plugins({name: (declare_body, yaml_body)})`` installs throwaway plugin distributions in a
    scratch folder (dist-info metadata with both entry points, a module, a conf package) and returns
    the environment that puts them on the path of a ``titan_core.run`` subprocess."""
    site = tmp_path / "site"

    def install(plugins: dict, distribution: str = "fake-plugins") -> dict:
        dist = site / f"{distribution.replace('-', '_')}-0.0.0.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.0.0\n")
        entry_points = ["[titan_core.plugins]"]
        conf_points = ["[titan_core.conf]"]
        for name, (declaration, options) in plugins.items():
            module = f"fake_{distribution.replace('-', '_')}_{name}"
            (site / f"{module}.py").write_text(textwrap.dedent(f"""
                from titan_core import Declaration, hookimpl

                @hookimpl
                def declare(plugin_config):
                    return {declaration}
                """))
            conf = site / f"{module}_conf" / "plugins"
            conf.mkdir(parents=True)
            (conf.parent / "__init__.py").write_text("")
            (conf / f"{name}.yaml").write_text(f"{name}:\n  _plugin_: {name}\n{textwrap.indent(options, '  ')}")
            entry_points.append(f"{name} = {module}")
            conf_points.append(f"{name} = {module}_conf")
        (dist / "entry_points.txt").write_text("\n".join(entry_points + [""] + conf_points) + "\n")
        return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return install


@pytest.fixture
def data_dir(tmp_path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path
