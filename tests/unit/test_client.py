"""Client configuration, error messages and message checks (no runtime needed)."""

import threading
import time

import numpy as np
import pytest
import zmq

from mixplane import wire
from mixplane.client import DeliveryError, MixtureLoader, check_step_data
from mixplane.planner.windows import ReplicaWindow
from mixplane.wire import Kind


def test_configuration_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("MIXPLANE_PLANNER", "tcp://127.0.0.1:1")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MIXPLANE_PREFETCH", "5")
    monkeypatch.setenv("MIXPLANE_TIMEOUT_S", "7.5")
    l = MixtureLoader()
    assert (l.rank, l.world_size, l.local_rank, l.prefetch, l.timeout_s) == (3, 4, 1, 5, 7.5)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="rank 4 outside WORLD_SIZE 4"):
        MixtureLoader()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x'"):
        MixtureLoader()
    monkeypatch.delenv("MIXPLANE_PLANNER")
    with pytest.raises(ValueError, match="MIXPLANE_PLANNER"):
        MixtureLoader(rank=0)


def _fake_planner(ctx, constructor_ep=None):
    """A ROUTER that answers ROUTE (pointing at constructor_ep) and nothing else."""
    s = ctx.socket(zmq.ROUTER)
    s.linger = 0
    port = s.bind_to_random_port("tcp://127.0.0.1")
    return s, f"tcp://127.0.0.1:{port}"


def _answer_route(planner, meta: dict):
    """A thread that answers the next ROUTE at the fake planner with `meta` (bounded wait)."""
    import threading

    def answer():
        if planner.poll(3000):
            route, _ = wire.recv(planner, routed=True)
            wire.send(planner, Kind.ROUTE_REPLY, meta, route=route)

    t = threading.Thread(target=answer)
    t.start()
    return t


def test_timeouts_name_the_endpoint():
    ctx = zmq.Context()
    try:
        planner, ep = _fake_planner(ctx)
        l = MixtureLoader(ep, rank=0, timeout_s=0.2, context=ctx)
        with pytest.raises(DeliveryError, match=f"no answer to route from the planner at {ep}"):
            next(l)
        l.close()
        while planner.poll(100):
            planner.recv_multipart()  # the unanswered request
        # a planner that routes to a silent constructor: the error names the constructor's endpoint
        silent = ctx.socket(zmq.ROUTER)
        silent.linger = 0
        cport = silent.bind_to_random_port("tcp://127.0.0.1")
        cep = f"tcp://127.0.0.1:{cport}"
        l = MixtureLoader(ep, rank=0, timeout_s=0.5, context=ctx)
        t = _answer_route(planner, {"endpoint": cep, "coords": {"rank": 0}, "sources": ["a"], "start_step": 0})
        with pytest.raises(DeliveryError, match=f"step 0 not delivered by constructor {cep} within 0.5s"):
            next(l)
        t.join()
        l.close()
    finally:
        ctx.destroy(linger=0)


def test_an_unanswered_route_is_asked_again_on_a_new_socket(monkeypatch):
    """A ROUTE the planner never got (its pod replaced behind the Service while the request was on the way; here:
    read and dropped) is asked again after ROUTE_RESEND_S, from a new socket, and answered: the client routes
    instead of waiting out its step timeout."""
    import mixplane.client as client_mod

    monkeypatch.setattr(client_mod, "ROUTE_RESEND_S", 0.3)
    ctx = zmq.Context()
    try:
        planner, ep = _fake_planner(ctx)
        l = MixtureLoader(ep, rank=0, timeout_s=5, context=ctx)
        asks: list[bytes] = []

        def drop_first_answer_second():
            while len(asks) < 2 and planner.poll(5000):
                route, msg = wire.recv(planner, routed=True)
                assert msg.kind == Kind.ROUTE and msg.meta == {"rank": 0}
                asks.append(route[0])
            wire.send(planner, Kind.ROUTE_REPLY, {"endpoint": "tcp://127.0.0.1:9", "coords": {"rank": 0}, "sources": ["a"],
                                                  "start_step": 0}, route=[asks[-1]])

        t = threading.Thread(target=drop_first_answer_second)
        t.start()
        t0 = time.monotonic()
        l._connect()
        took = time.monotonic() - t0
        t.join()
        assert l.endpoint == "tcp://127.0.0.1:9" and took < 3, took
        assert len(asks) == 2 and asks[0] != asks[1]  # the second ask came from a new socket (a new connection)
        l.close()
    finally:
        ctx.destroy(linger=0)


def _msg(**arrays):
    return wire.decode(wire.encode(Kind.STEP_DATA, {"step": 1, "rank": 0, "seq_len": 4}, arrays))


def test_check_step_data_rejects_inconsistent_batches():
    ok = dict(input_ids=np.zeros((2, 4), np.int64), labels=np.zeros((2, 4), np.int64),
              cu_seqlens=np.array([0, 3, 4, 8], np.int32))
    check_step_data(_msg(**ok), 1, 0, "c")
    with pytest.raises(DeliveryError, match="not strictly increasing"):
        check_step_data(_msg(**{**ok, "cu_seqlens": np.array([0, 5, 5, 8], np.int32)}), 1, 0, "c")
    with pytest.raises(DeliveryError, match="ends at 7"):
        check_step_data(_msg(**{**ok, "cu_seqlens": np.array([0, 7], np.int32)}), 1, 0, "c")
    with pytest.raises(DeliveryError, match="labels has shape"):
        check_step_data(_msg(**{**ok, "labels": np.zeros((1, 4), np.int64)}), 1, 0, "c")
    with pytest.raises(DeliveryError, match="addressed to rank 0"):
        check_step_data(_msg(**ok), 1, 3, "c")


def test_load_state_dict_validation():
    l = MixtureLoader("tcp://127.0.0.1:1", rank=0)
    with pytest.raises(ValueError, match="version"):
        l.load_state_dict({"version": 99})
    with pytest.raises(ValueError, match="no cursor"):
        l.load_state_dict({"version": 1, "next_step": 5, "cursor": None})
    with pytest.raises(ValueError, match="inconsistent"):
        l.load_state_dict({"version": 1, "next_step": 5, "cursor": {"step": 4}})
    l.load_state_dict({"version": 1, "next_step": 0, "cursor": None})  # before the first step: restart at 0
    assert l.state_dict()["next_step"] == 0


def test_restored_window_cursor_keeps_partial_progress():
    # regression: a planner window restored from a cursor must hand the same partial progress to the
    # loader it re-seeks, or both sides disagree on when the window is full (resume hung)
    w = ReplicaWindow(0, 0, 8, 256)
    w.restore({"low": 16, "next": 31, "skip": [19, 20], "partial": {"16": 32}})
    assert w.cursor()["partial"] == {"16": 32}
    w.add(np.array([16, 17]), np.array([1, 2]), np.array([35, 10]), np.zeros(2, np.int64))
    assert w.cursor()["partial"] == {"16": 32} and w.unconsumed_tokens == 13


def test_a_world_size_other_than_the_topology_is_refused():
    """torchrun with fewer ranks than the mixture's topology would train on part of every batch."""
    ctx = zmq.Context()
    try:
        planner, ep = _fake_planner(ctx)
        t = _answer_route(planner, {"endpoint": "tcp://127.0.0.1:9", "coords": {"rank": 0}, "sources": ["a"],
                                    "start_step": 0, "world_size": 8})
        l = MixtureLoader(ep, rank=1, world_size=4, timeout_s=3, context=ctx)
        with pytest.raises(DeliveryError, match=f"WORLD_SIZE is 4 but the mixture served by {ep} has a topology of 8 ranks"):
            next(l)
        t.join()
        l.close()
    finally:
        ctx.destroy(linger=0)


def test_lookahead_is_sized_in_seconds_of_training():
    from mixplane.client import lookahead_steps

    assert lookahead_steps(10.0, None, 2, 32) == 2  # step time not measured yet
    assert lookahead_steps(10.0, 0.5, 2, 32) == 20  # 10 s of 0.5 s steps
    assert lookahead_steps(10.0, 0.25, 2, 32) == 32  # bounded by what constructors and loaders hold
    assert lookahead_steps(10.0, 14.0, 2, 32) == 2  # steps longer than the buffer: the least
    assert lookahead_steps(0.0, 0.1, 3, 32) == 3  # off: the fixed depth
    assert lookahead_steps(1.0, 0.3, 0, 32) == 4  # rounds up: never less than the seconds asked for


def test_prefetch_alone_is_a_fixed_depth_and_prefetch_s_a_time_sized_one(monkeypatch):
    monkeypatch.delenv("MIXPLANE_PREFETCH", raising=False)
    monkeypatch.delenv("MIXPLANE_PREFETCH_S", raising=False)
    fixed = MixtureLoader("tcp://127.0.0.1:1", rank=0, prefetch=3)
    fixed._step_times.extend([0.01] * 9)
    assert fixed.lookahead == 3  # prefetch= alone: exactly that, as before the look-ahead existed
    timed = MixtureLoader("tcp://127.0.0.1:1", rank=0, prefetch_s=2.0)
    timed._step_times.extend([0.1, 0.1, 5.0, 0.1, 0.1])  # one slow step (a checkpoint) does not shrink it
    assert timed.lookahead == 20
    monkeypatch.setenv("MIXPLANE_PREFETCH_S", "x")
    with pytest.raises(ValueError, match="MIXPLANE_PREFETCH_S='x'"):
        MixtureLoader("tcp://127.0.0.1:1", rank=0)
