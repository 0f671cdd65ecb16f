"""Application-level liveness (issue 11 item 1): a loader that hangs (SIGSTOP) is found silent by the
planner within the miss budget, named in STATUS and in the error of a client that waited for it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mixplane.client import DeliveryError, MixtureLoader
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.conftest import token_mixture

pytestmark = pytest.mark.timeout(300)


def test_a_hung_loader_is_reported_by_name_to_status_and_the_waiting_client(token_sources, tmp_path):
    spec = parse_spec(token_mixture(token_sources["root"], runtime={"window": 16, "heartbeat_s": 0.5}))
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        comps = rt.endpoints()["components"]
        victim = next(n for n in comps if n.startswith("loader-a"))
        pid = comps[victim]["pid"]
        time.sleep(2.0)
        assert "loader:a:0" not in rt.status()["silent"]  # it beats (a loaded machine may delay others)
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 20
            silent: dict = {}
            while time.monotonic() < deadline and "loader:a:0" not in silent:
                time.sleep(0.3)
                silent = rt.status()["silent"]
            assert silent["loader:a:0"] >= 1.5  # 3 missed beats of 0.5 s (STATUS rounds to 0.1 s)
            client = MixtureLoader(rt.planner_endpoint, rank=0, timeout_s=4)
            with pytest.raises(DeliveryError, match=r"waiting since .*silent: .*loader:a:0 for"):
                for _ in range(10_000):  # the stopped loader's window runs dry within a few steps
                    next(client)
            client.close()
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "loader:a:0" in rt.status()["silent"]:
            time.sleep(0.3)
        assert "loader:a:0" not in rt.status()["silent"]  # talks again: no longer reported
        assert not rt.dead()
