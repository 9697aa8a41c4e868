"""The range the node script derives torchrun's master port from (port base + job id % span)."""

from __future__ import annotations

from pathlib import Path

from megatron_hpc.plan.jobs import MASTER_PORT_BASE, MASTER_PORT_SPAN


def test_the_derived_master_ports_are_never_the_kernels_ephemeral_ones() -> None:
    # An ephemeral port held by any outgoing connection or port-0 listener on the node would make the job's
    # rendezvous fail with EADDRINUSE (it did, in this suite, when the range reached into them).
    low, _high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = range(MASTER_PORT_BASE, MASTER_PORT_BASE + MASTER_PORT_SPAN)
    assert ports[-1] < low
    assert 62182 not in ports and 8547 not in ports  # the Neuron runtime's root-comm and XLA's coordinator ports
    assert len(ports) >= 10_000  # jobs sharing a first node still rarely draw the same port
