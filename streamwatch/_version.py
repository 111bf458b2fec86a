"""The distribution's name and version, in one place.

streamwatch is installed as ``streamwatch-torch`` (``pip install streamwatch-torch``) and imported as
``streamwatch``: the name ``streamwatch`` on the Python package index belongs to an unrelated project (a
live-stream command line tool, which also installs a module named ``streamwatch``; the two cannot share
an environment). Everything that names the distribution — the version lookup, ``streamwatch --version``,
every error that names an extra to install — reads it here.

Example:
    >>> DISTRIBUTION, extra("demo")
    ('streamwatch-torch', "pip install 'streamwatch-torch[demo]'")
    >>> version() == version()  # read once
    True
"""

from __future__ import annotations

import functools
from importlib import metadata

__all__ = ["DISTRIBUTION", "UNKNOWN", "extra", "version"]

DISTRIBUTION = "streamwatch-torch"
"""The name streamwatch is installed under (the import name stays ``streamwatch``)."""

UNKNOWN = "0+unknown"
"""The version of a source tree that is on ``sys.path`` without being installed."""


@functools.cache  # (reading the package metadata costs about a millisecond)
def version() -> str:
    """The installed distribution's version; :data:`UNKNOWN` if it is not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNKNOWN


def extra(name: str) -> str:
    """The command that installs the optional extra ``name``, as errors and docs give it."""
    return f"pip install '{DISTRIBUTION}[{name}]'"
