"""Ports for servers that tests kill and restart: the restart must get its port back."""

from __future__ import annotations

from sidecar_runtime.process.procs import ephemeral_range, free_port


def test_ports_are_outside_the_ephemeral_range_and_never_repeat() -> None:
    # Inside the range, an outgoing connection made while the server is down can take the
    # port as its source port, and the restart fails with "address in use" (seen in CI:
    # a killed Redis Cluster node on port 54080 could not come back).
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(port < low or port > high for port in ports)


def test_a_cluster_port_and_its_bus_port_are_both_restartable() -> None:
    low, high = ephemeral_range()
    port = free_port(also_free=10000)
    assert all(p < low or p > high for p in (port, port + 10000))
    assert port + 10000 < 65536

