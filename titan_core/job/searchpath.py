"""Lets installed plugin distributions add their Hydra options (``plugins/<name>.yaml``).

For each entry point in the ``titan_core.conf`` group, ``pkg://<package>`` is appended to Hydra's
search path. Only distribution metadata is read, so no plugin code is imported to compose a config.
The launcher registers this class with Hydra directly instead of shipping it in the ``hydra_plugins``
namespace package: Hydra cannot list that namespace through setuptools' editable-install finder.
"""

from importlib.metadata import entry_points

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from titan_core.job.schema import CONF_GROUP


class PluginConfigSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for ep in sorted(entry_points(group=CONF_GROUP), key=lambda ep: ep.name):
            search_path.append(provider=f"{CONF_GROUP}.{ep.name}", path=f"pkg://{ep.value}")
