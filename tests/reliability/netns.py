"""A node behind a network link that can be cut: a network namespace joined to the host by
a veth pair (needs root and iproute2's `ip netns`)."""

from __future__ import annotations

import os
import subprocess
import uuid

from tests.reliability.deployment import Agent

__all__ = ["HOST_IP", "NODE_IP", "Link", "behind", "namespaces_work"]

HOST_IP, NODE_IP = "10.231.7.1", "10.231.7.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Link:
    """A network namespace joined to the host by a veth pair that can be cut."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.namespace, self.host_end, self.node_end = f"rs-{tag}", f"rsh-{tag}", f"rsn-{tag}"

    def __enter__(self) -> Link:
        _ip("netns", "add", self.namespace)
        _ip("link", "add", self.host_end, "type", "veth", "peer", "name", self.node_end)
        _ip("link", "set", self.node_end, "netns", self.namespace)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", self.host_end)
        _ip("link", "set", self.host_end, "up")
        inside = ("-n", self.namespace)
        _ip(*inside, "addr", "add", f"{NODE_IP}/30", "dev", self.node_end)
        _ip(*inside, "link", "set", self.node_end, "up")
        _ip(*inside, "link", "set", "lo", "up")
        return self

    def cut(self) -> None:
        _ip("link", "set", self.host_end, "down")

    def mend(self) -> None:
        _ip("link", "set", self.host_end, "up")

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "link", "del", self.host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)


def namespaces_work() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        with Link():
            return True
    except (OSError, subprocess.CalledProcessError):
        return False


def behind(link: Link, nats_port: int) -> dict[str, Agent]:
    """Two agents: node-a on the host, node-b inside `link`'s namespace, reaching the NATS
    server (listening on every address, port `nats_port`) across the link."""
    return {
        "node-a": Agent(address=HOST_IP),
        "node-b": Agent(
            within=("ip", "netns", "exec", link.namespace),
            nats_url=f"nats://{HOST_IP}:{nats_port}",
            address=NODE_IP,
        ),
    }
