"""Network partitions between etcd members: each member in a network namespace of its own.

The namespaces are joined by veth links to one bridge in the host's namespace, on a
private /24 that exists only on this machine (the bridge has no uplink), so the
test process and the workers reach every member directly. A partition adds
``blackhole`` routes between two members, both ways: their established
connections stall and new ones fail, while clients still reach both. Healing
deletes the routes. Needs root and ``ip`` (iproute2); :meth:`create` raises
:class:`PartitionsUnsupported`, saying why, where that is not available.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import subprocess

_instances = itertools.count()


class PartitionsUnsupported(RuntimeError):
    pass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


class Partitions:
    def __init__(self, size: int) -> None:
        # Another instance of this process may not be gone yet: the kernel deletes the
        # links of a deleted namespace in the background. Hence a count as well.
        tag = (os.getpid() * 10 + next(_instances)) % 100_000
        self.size = size
        self.bridge = f"elb{tag}"
        self.namespaces = [f"etcd-leases-{tag}-{i}" for i in range(size)]
        subnet = f"10.213.{tag % 250}"
        self.hosts = [f"{subnet}.{i + 1}" for i in range(size)]
        self.bridge_address = f"{subnet}.254/24"
        self._cut: set[tuple[int, int]] = set()
        self._created: list[str] = []

    @property
    def command_prefixes(self) -> list[list[str]]:
        return [["ip", "netns", "exec", namespace] for namespace in self.namespaces]

    def create(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise PartitionsUnsupported("network namespaces need root and iproute2's 'ip'")
        atexit.register(self.destroy)  # should the test process end without its finally
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._created.append("bridge")
            _ip("addr", "add", self.bridge_address, "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (namespace, host) in enumerate(zip(self.namespaces, self.hosts, strict=True)):
                _ip("netns", "add", namespace)
                self._created.append(namespace)
                veth = f"{self.bridge}v{i}"
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", namespace, "addr", "add", f"{host}/24", "dev", "eth0")
                _ip("-n", namespace, "link", "set", "eth0", "up")
                _ip("-n", namespace, "link", "set", "lo", "up")
        except (OSError, subprocess.CalledProcessError) as exc:
            self.destroy()
            detail = getattr(exc, "stderr", "") or exc
            raise PartitionsUnsupported(f"cannot set up network namespaces: {detail}") from exc

    def destroy(self) -> None:
        for created in reversed(self._created):
            with contextlib.suppress(OSError, subprocess.CalledProcessError):
                if created == "bridge":
                    _ip("link", "del", self.bridge)
                else:
                    _ip("netns", "del", created)
        self._created = []

    def _route(self, action: str, a: int, b: int) -> None:
        _ip("-n", self.namespaces[a], "route", action, "blackhole", f"{self.hosts[b]}/32")

    def isolate(self, member: int) -> None:
        """Cut the member in namespace ``member`` (its index in the cluster's members; a
        replacement takes the index, and namespace, of the member it replaced) off from
        every other member, both ways."""
        for other in range(self.size):
            if other != member:
                for a, b in ((member, other), (other, member)):
                    self._route("add", a, b)
                    self._cut.add((a, b))

    def heal(self) -> None:
        for a, b in sorted(self._cut):
            self._route("del", a, b)
        self._cut.clear()
