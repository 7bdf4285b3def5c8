"""Named corrections, losses, tasks and verifiers, registered through the entry-point group `nemo_rz.plugins`.

An entry point `<kind>.<name> = module:object` makes `object` available as `name` of that kind, e.g.
`correction.my_corr = my_pkg.corr:MY_CORR` lets a config say algo.correction=my_corr. nemo-rz registers its
own built-ins the same way (setup.py), so a plugin and a built-in are found, checked and loaded alike.
docs/plugins.md says what each kind's object must be.

Listing names reads package metadata only (once, then cached): nothing is imported until a name is loaded.
"""
from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from importlib import metadata

from nemo_rz.errors import PluginError

GROUP = "nemo_rz.plugins"
KINDS = ("correction", "loss", "task", "verifier")
_HOME = "nemo-rz"  # the distribution whose entry points are the built-ins
# The order lists show nemo-rz's own names in (installed metadata holds them sorted): the default first, then the
# baselines in the order the docs compare them; unlisted names follow, alphabetically.
_SHOWN_FIRST = ("reinforce_zero", "ppo_clip", "none", "unclipped", "tis", "token_mask", "seq_gate", "seq_gate_kl", "cis")


@functools.cache
def _entry_points() -> dict[str, dict[str, list[metadata.EntryPoint]]]:
    """kind -> name -> the entry points registering it (more than one is a conflict); nemo-rz's own first."""
    found = {kind: {} for kind in KINDS}
    eps = sorted(metadata.entry_points(group=GROUP), key=_shown)
    for ep in eps:
        kind, dot, name = ep.name.partition(".")
        if kind not in found or not dot or not name:
            raise PluginError(f"entry point {ep.name!r} of {_dist(ep)} in group {GROUP}: name it <kind>.<name> "
                              f"with kind one of {', '.join(KINDS)}")
        found[kind].setdefault(name, []).append(ep)
    if not any(_dist(ep) == _HOME for ep in eps):
        raise PluginError(f"no built-in plugins found: nemo-rz's entry points ({GROUP}) are not installed; "
                          "reinstall it (pip install -e . in the checkout)")
    return found


def _shown(ep: metadata.EntryPoint) -> tuple:
    name = ep.name.partition(".")[2]
    rank = _SHOWN_FIRST.index(name) if name in _SHOWN_FIRST else len(_SHOWN_FIRST)
    return _dist(ep) != _HOME, rank, ep.name, _dist(ep)


def _dist(ep: metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "an unknown distribution"


def _kind(kind: str) -> dict[str, list[metadata.EntryPoint]]:
    if kind not in KINDS:
        raise ValueError(f"plugin kind {kind!r}: use one of {', '.join(KINDS)}")
    return _entry_points()[kind]


def names(kind: str) -> tuple[str, ...]:
    """Every registered name of this kind: the built-ins in their order, then plugins' (nothing is imported)."""
    return tuple(_kind(kind))


def unknown(kind: str, name: str) -> str:
    """The one-line message for a name that is not registered: did-you-mean and the list."""
    known = names(kind)
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown {kind} {name!r}{hint}: use one of {', '.join(known)}"


@functools.cache
def load(kind: str, name: str):
    """The object registered as `name`; PluginError when it is unknown, registered twice, or fails to import."""
    eps = _kind(kind).get(name)
    if not eps:
        raise PluginError(unknown(kind, name))
    if len(eps) > 1:
        who = " and ".join(f"{_dist(ep)} ({ep.value})" for ep in eps)
        raise PluginError(f"{kind} {name!r} is registered by both {who}; uninstall one of them")
    ep = eps[0]
    where = f"{kind} {name!r} (entry point {ep.name} = {ep.value} of {_dist(ep)})"
    try:
        obj = ep.load()
    except Exception as e:  # a plugin's import error must name the plugin, not surface as a traceback
        reason = str(e).splitlines()[0] if str(e) else ""
        raise PluginError(f"{where} failed to load: {type(e).__name__}{': ' + reason if reason else ''}") from None
    if kind != "correction" and not callable(obj):  # a correction is a Correction, checked where it is used
        raise PluginError(f"{where} is a {type(obj).__name__}, not a callable; see docs/plugins.md")
    return obj


def refresh() -> None:
    """Forget what was read and loaded (after installing or removing a plugin in a running process)."""
    _entry_points.cache_clear()
    load.cache_clear()


class Registry(Mapping):
    """A read-only name -> object view of one kind; objects are loaded on first access."""

    def __init__(self, kind: str):
        self.kind = kind

    def __getitem__(self, name: str):
        if name not in self:
            raise KeyError(name)
        return load(self.kind, name)

    def __contains__(self, name) -> bool:
        return name in names(self.kind)

    def __iter__(self):
        return iter(names(self.kind))

    def __len__(self) -> int:
        return len(names(self.kind))

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self)})"
