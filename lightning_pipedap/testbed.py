"""A multi-host testbed on one machine: network namespaces, veth pairs, a bridge and ``tc tbf`` caps.

Each rank runs in its own network namespace ``<prefix>h<i>`` with address ``10.77.0.<i+1>/24`` on a
veth link to a bridge in the root namespace; both directions of every host link are rate limited
with a token-bucket filter, so gloo traffic between ranks crosses a real capped link (the
``netem`` qdisc is not available on these machines; ``tbf`` is). Needs root (CAP_NET_ADMIN).
Only addresses created inside these namespaces are used; everything is removed on exit, on
failure and on Ctrl-C.

Usage::

    with Testbed(hosts=2, rate="1gbit") as tb:
        tb.run_ranks(["python", "-m", "lightning_pipedap.bench.bandwidth"], timeout_s=300)
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["Testbed", "TestbedUnavailable", "testbed_available"]


class Terminated(SystemExit):
    """Raised in the main thread on SIGTERM while a :class:`Testbed` is up (so its clean-up runs)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(128 + signum)


class TestbedUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, or no ``ip``/``tc``)."""


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=30)


def testbed_available() -> tuple[bool, str]:
    """Return ``(ok, reason)``: whether namespaces, veth and tbf can be created here."""
    if os.name != "posix" or os.geteuid() != 0:
        return False, "the testbed needs root (CAP_NET_ADMIN) to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' (iproute2) is not installed"
    name = f"pdprobe{uuid.uuid4().hex[:6]}"
    r = _sh("ip", "netns", "add", name, check=False)
    if r.returncode != 0:
        return False, f"cannot create a network namespace: {r.stderr.strip()}"
    _sh("ip", "netns", "del", name, check=False)
    return True, ""


@dataclass
class Testbed:
    """``hosts`` namespaces joined by a bridge, each host link capped at ``rate`` in both directions.

    Args:
        hosts: number of hosts (ranks), >= 2.
        rate: tc rate string (``"1gbit"``, ``"10gbit"``) or ``None`` for an uncapped link.
        prefix: name prefix of namespaces and links (unique per testbed by default).

    Raises:
        TestbedUnavailable: from :meth:`__enter__` when namespaces cannot be created here.
        ValueError: for ``hosts < 2``.
    """

    hosts: int = 2
    rate: str | None = "1gbit"
    prefix: str = field(default_factory=lambda: f"pd{uuid.uuid4().hex[:4]}")
    _created: list[tuple[str, str]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.hosts < 2:
            raise ValueError(f"a testbed needs at least 2 hosts, got {self.hosts}")

    def address(self, i: int) -> str:
        """IPv4 address of host ``i`` (inside its namespace)."""
        return f"10.77.{int(self.prefix[2:], 16) % 250}.{i + 1}"

    def ns(self, i: int) -> str:
        """Name of host ``i``'s network namespace."""
        return f"{self.prefix}h{i}"

    # --------------------------------------------------------------------- set-up / clean-up
    def __enter__(self) -> "Testbed":
        ok, why = testbed_available()
        if not ok:
            raise TestbedUnavailable(why)
        self._old_sigint = signal.getsignal(signal.SIGINT)
        self._old_sigterm = None
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (``timeout``, ``kill``, a batch scheduler) would end the interpreter without running
            # ``__exit__``: turn it into an exception so the namespaces, links and bridge are removed
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            self._create()
        except BaseException:
            self.cleanup()
            self._restore_sigterm()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.cleanup()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _create(self) -> None:
        br = f"{self.prefix}br"
        _sh("ip", "link", "add", br, "type", "bridge")
        self._created.append(("link", br))
        _sh("ip", "link", "set", br, "up")
        for i in range(self.hosts):
            ns, host_if, br_if = self.ns(i), f"{self.prefix}e{i}", f"{self.prefix}b{i}"
            _sh("ip", "netns", "add", ns)
            self._created.append(("netns", ns))
            _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", br_if)
            self._created.append(("link", br_if))
            _sh("ip", "link", "set", host_if, "netns", ns)
            _sh("ip", "link", "set", br_if, "master", br)
            _sh("ip", "link", "set", br_if, "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", host_if)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", host_if, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            if self.rate:
                # egress of the host (host -> bridge) and egress of the bridge port (bridge -> host)
                tbf = ["tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", host_if, "root", *tbf)
                _sh("tc", "qdisc", "add", "dev", br_if, "root", *tbf)

    def cleanup(self) -> None:
        """Remove every namespace and link this testbed created (idempotent, never raises)."""
        for kind, name in reversed(self._created):
            if kind == "netns":
                _sh("ip", "netns", "pids", name, check=False)
                pids = _sh("ip", "netns", "pids", name, check=False).stdout.split()
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                _sh("ip", "netns", "del", name, check=False)
            else:
                _sh("ip", "link", "del", name, check=False)
        self._created.clear()

    # --------------------------------------------------------------------- running ranks
    def run_ranks(self, argv: Sequence[str], timeout_s: float = 600.0, env: dict[str, str] | None = None,
                  port: int = 29555) -> list[str]:
        """Run ``argv`` once per host (rank i in namespace i, master = host 0); return each rank's output.

        The environment carries ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``,
        ``LOCAL_RANK=0``-style variables for Lightning (``NODE_RANK=i``, ``LOCAL_RANK=0``) and
        ``GLOO_SOCKET_IFNAME`` so gloo uses the capped link.

        Raises:
            TimeoutError: if a rank runs longer than ``timeout_s`` (all ranks are killed).
            RuntimeError: if a rank exits non-zero (its output tail is in the message).
        """
        procs = []
        for i in range(self.hosts):
            e = dict(os.environ, **(env or {}))
            e.update(
                MASTER_ADDR=self.address(0), MASTER_PORT=str(port), WORLD_SIZE=str(self.hosts), RANK=str(i),
                NODE_RANK=str(i), LOCAL_RANK="0", GLOO_SOCKET_IFNAME=f"{self.prefix}e{i}", PYTHONUNBUFFERED="1",
            )
            cmd = ["ip", "netns", "exec", self.ns(i), *argv]
            procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout_s
        outs = [""] * self.hosts
        try:
            for i, p in enumerate(procs):
                left = max(1.0, deadline - time.monotonic())
                try:
                    outs[i], _ = p.communicate(timeout=left)
                except subprocess.TimeoutExpired:
                    raise TimeoutError(f"rank {i} still running after {timeout_s} s: {' '.join(argv)}") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        bad = [i for i, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise RuntimeError("ranks " + str(bad) + " failed:\n"
                               + "\n".join(f"--- rank {i}\n{outs[i][-4000:]}" for i in bad))
        return outs
