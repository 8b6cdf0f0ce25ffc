"""Ports for a tritonserver: three distinct ones, and a clear error before starting when two are the same.

CI once handed gRPC and metrics the same port (free_port() three times: the kernel gave a just-released port
out again) and tritonserver refused to start. The kernel's choice is not something a test controls, so the
rule is checked against a stand-in socket that behaves as that kernel did: it hands out the lowest port not
bound right now.
"""

from __future__ import annotations

import socket

import pytest

from specpipe.cli import main
from specpipe.triton.server import ServerConfig, free_port, free_ports


class _ReusingKernel:
    """socket.socket stand-in: bind(port 0) gets the lowest port no open stand-in holds (a released one at once)."""

    held: set[int] = set()

    def __init__(self, *args):
        self.port = None

    def bind(self, address):
        self.port = min(set(range(40000, 40100)) - _ReusingKernel.held)
        _ReusingKernel.held.add(self.port)

    def getsockname(self):
        return ("127.0.0.1", self.port)

    def close(self):
        _ReusingKernel.held.discard(self.port)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture
def reusing_kernel(monkeypatch):
    _ReusingKernel.held = set()
    monkeypatch.setattr(socket, "socket", _ReusingKernel)


def test_free_ports_are_distinct_even_where_the_kernel_reuses_a_released_port_at_once(reusing_kernel):
    assert [free_port(), free_port(), free_port()] == [40000] * 3  # the stand-in reuses, as CI's kernel did
    assert sorted(free_ports(4)) == [40000, 40001, 40002, 40003]
    config = ServerConfig.on_free_ports(ready_timeout_s=5)
    assert len({config.grpc_port, config.http_port, config.metrics_port}) == 3
    assert config.ready_timeout_s == 5
    assert not _ReusingKernel.held  # every socket released once chosen


def test_free_ports_are_free_on_this_machine():
    ports = free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:  # nothing listens there: each can be bound again
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("ports, named", [
    (dict(grpc_port=9001, http_port=9001, metrics_port=9002), "--grpc-port and --http-port are both 9001"),
    (dict(grpc_port=9001, http_port=9000, metrics_port=9001), "--grpc-port and --metrics-port are both 9001"),
    (dict(grpc_port=9001, http_port=9002, metrics_port=9002), "--http-port and --metrics-port are both 9002"),
])
def test_a_server_config_with_a_port_used_twice_is_refused(ports, named):
    with pytest.raises(ValueError, match=named):
        ServerConfig(**ports)


def test_serve_with_one_port_twice_is_a_one_line_error_and_starts_nothing(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tmp_path), "--grpc-port", "9101", "--metrics-port", "9101"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error:") and "--grpc-port and --metrics-port are both 9101" in lines[0], err
