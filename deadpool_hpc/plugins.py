"""Entry-point plugins, shared by every extension point (docs/plugins.md). Small and dependency-free on purpose.

Groups: ``deadpool_hpc.detectors`` (node-health detectors, agent/health.py) and ``deadpool_hpc.transports``
(replica transports, replica/transports.py). A plugin is a pip-installable distribution that registers an object in
one of them; the built-in implementations are registered the same way (pyproject.toml).
"""
from __future__ import annotations

from importlib import metadata

from .errors import ConfigError


class PluginError(ConfigError):
    """A plugin failed to import, raised at start-up, or returned an object without the interface. The message
    names the plugin (group, entry point name and target) and the error."""


def entry_points(group: str) -> list:
    """The entry points installed in ``group``, by name."""
    return sorted(metadata.entry_points().select(group=group), key=lambda ep: ep.name)


def names(group: str) -> list[str]:
    return [ep.name for ep in entry_points(group)]


def load(ep, what: str):
    """``ep.load()``; PluginError naming the plugin (``what``: "detector", "replica transport") if it fails."""
    try:
        return ep.load()
    except Exception as exc:  # noqa: BLE001 - any import-time error of a plugin is reported the same way
        raise PluginError(f"{what} plugin {ep.name!r} ({ep.value}) failed to import: {type(exc).__name__}: {exc}; "
                          f"fix or uninstall it (installed: {', '.join(names(ep.group))})") from exc


def load_named(group: str, name: str, what: str, option: str):
    """The object registered as ``name`` in ``group``. Raises PluginError if none is, naming ``option`` and the
    installed names, or if it fails to import."""
    for ep in entry_points(group):
        if ep.name == name:
            return load(ep, what)
    raise PluginError(f"{option} {name!r}: no {what} of that name is installed; accepted: "
                      f"{', '.join(names(group)) or '(none)'}")
