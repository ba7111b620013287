"""Lets installed plugin distributions add their Hydra options (``plugins/<name>.yaml``).

Hydra imports every module under the ``hydra_plugins`` namespace package; this one appends
``pkg://<package>`` for each entry point in the ``titan_core.conf`` group. Only distribution metadata
is read, so no plugin code is imported to compose a config.
"""

from importlib.metadata import entry_points

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class TitanCoreSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for ep in sorted(entry_points(group="titan_core.conf"), key=lambda ep: ep.name):
            search_path.append(provider=f"titan_core.conf.{ep.name}", path=f"pkg://{ep.value}")
