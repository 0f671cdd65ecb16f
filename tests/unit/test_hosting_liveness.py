"""The planner's view of loader-host liveness (issue 22 items 3 and 4): a host is failed over for the beats it
missed while the planner listened (not for stretches in which the planner's own loop did not turn), and a shadow
is promotable only when heard from within two of its beats."""

from __future__ import annotations

import time
from types import SimpleNamespace

from mixplane import protocol
from mixplane.component import Membership
from mixplane.planner.hosting import PartitionHosting


class Hosting(PartitionHosting):
    """Partition hosting over the part of a planner server (its HostingServer interface) that liveness reads."""

    def __init__(self) -> None:
        super().__init__(SimpleNamespace(spec=SimpleNamespace(runtime=SimpleNamespace(shadow_loaders=1, failover_after_s=1.0)),
                                         core=SimpleNamespace(windows=[SimpleNamespace(source=0, replica=0)]),
                                         members=Membership(), loaders={}))
        self.members = self.server.members

    def beat(self, host: str) -> None:
        self.host_ids[host] = protocol.host_identity(host).encode()
        self.members.seen(protocol.beat_identity(host))


def test_silence_counts_only_while_the_planner_listened():
    h = Hosting()
    h.beat("h")
    t0 = time.monotonic()
    time.sleep(0.3)
    assert 0.28 <= h.host_missed_s("h") <= 1.0
    # the planner's loop did not turn for those 0.3 s (a long re-plan, no CPU): the host missed nothing
    h._deaf.append((t0 - 0.01, time.monotonic()))
    assert h.host_missed_s("h") < 0.05
    assert h.host_silent_s("h") >= 0.28  # what STATUS reports is unchanged
    # a host silent past the window while the planner listened is not alive; deaf time elsewhere does not help it
    h2 = Hosting()
    h2.beat("h")
    h2.members.peers[protocol.beat_identity("h")].last_seen -= 1.5
    h2._deaf.append((time.monotonic() - 10, time.monotonic() - 9))  # before its silence began
    assert not h2.host_alive("h")
    h2._deaf.append((time.monotonic() - 1.4, time.monotonic() - 0.2))  # 1.2 s of its 1.5 s silence were deaf
    assert h2.host_alive("h")


def test_a_shadow_is_fresh_only_within_two_of_its_beats():
    h = Hosting()  # failover_after_s 1.0: hosts beat every 0.25 s
    h.beat("s")
    assert h.host_fresh("s") and h.host_alive("s")
    h.members.peers[protocol.beat_identity("s")].last_seen -= 0.7  # died 0.7 s ago: alive by the window, not fresh
    assert h.host_alive("s") and not h.host_fresh("s")
