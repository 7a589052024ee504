"""replicator: a multiprocess worker-pool replication node.

The code lives in three subpackages, kept as top-level folders of the repository and installed under this one
import root (setuptools `package-dir`): `replicator.coordinator` (the coordinator process),
`replicator.workers` (the worker processes) and `replicator.shared` (what both use).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

# Run from a checkout (`src/` on the path, no install): the subpackages are the folders at the top of the tree.
# Installed, they sit under this package and the folder two levels up is site-packages' parent, which has none.
_checkout = Path(__file__).resolve().parents[2]
if (_checkout / "coordinator" / "__init__.py").is_file() and str(_checkout) not in __path__:
    __path__.append(str(_checkout))

try:
    __version__ = metadata.version("replicator")
except metadata.PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0+unknown"
