"""Where the real binaries the cluster tests run live.

hack/build-controlplane.sh and hack/controlplane-deps.sh put every binary into one
directory, $SHAPESHIFT_BIN (default $SHAPESHIFT_CACHE/bin, with $SHAPESHIFT_CACHE
defaulting to ~/.cache/shapeshift, the same rule as hack/lib.sh). This module only
resolves paths; it never downloads or builds anything.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CONTROL_PLANE_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
SETUP_HINT = "run `bash hack/controlplane-deps.sh` (a cold build takes about 7 minutes, later runs under a second)"


class ToolMissing(RuntimeError):
    """A binary the tests need is not installed where the harness looks."""


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shapeshift"
    return Path(os.environ.get("SHAPESHIFT_CACHE") or default)


def bin_dir() -> Path:
    return Path(os.environ.get("SHAPESHIFT_BIN") or cache_dir() / "bin")


def find(name: str) -> Path | None:
    """Path of the binary `name` in $SHAPESHIFT_BIN, or None.

    Only prometheus may also come from PATH (Debian installs it in /usr/bin);
    kubectl and helm must be the v1.37 ones from the cache, because machines often
    carry an older kubectl on PATH.
    """
    candidate = bin_dir() / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    if name == "prometheus":
        found = shutil.which("prometheus")
        return Path(found) if found else None
    return None


def require(name: str) -> Path:
    path = find(name)
    if path is None:
        raise ToolMissing(f"{name} not found in {bin_dir()}; {SETUP_HINT}")
    return path


def missing(names: tuple[str, ...] | list[str] = CONTROL_PLANE_BINARIES) -> list[str]:
    return [name for name in names if find(name) is None]


def kubectl() -> Path:
    return require("kubectl")


def helm() -> Path:
    return require("helm")


def prometheus() -> Path:
    return require("prometheus")
