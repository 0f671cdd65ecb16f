"""The embedded runtime is secure by default: role keys in a 0700 key dir, CURVE on every socket, control
requests and `mixplane status|update` with the admin key; `runtime.security: open` opens it on purpose.
Also what a run leaves for later (the previous journal) and the spec's step timeout reaching clients."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from mixplane.client import MixtureLoader
from mixplane.control import ControlCurve, request, status
from mixplane.planner.journal import archived, read_journal
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from mixplane.wire import Kind
from tests.conftest import token_mixture
from tests.integration.test_runtime import fetch

pytestmark = pytest.mark.timeout(240)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mixplane.cli", *args], capture_output=True, text=True, timeout=60,
                          env=env if env is not None else os.environ.copy())


def _env_without_keys() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("MIXPLANE_CURVE_DIR", "MIXPLANE_CURVE_NAME")}


def test_secure_by_default_only_the_runs_keys_get_in(token_sources, tmp_path):
    spec = parse_spec(token_mixture(token_sources["root"]))
    assert spec.runtime.security == "secure" and not spec.runtime.curve.enabled
    before = os.environ.get("MIXPLANE_CURVE_DIR")
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        keys = tmp_path / "run" / "keys"
        assert rt.key_dir == keys
        assert stat.S_IMODE(keys.stat().st_mode) == 0o700
        for role in ("server", "component", "client", "admin"):
            assert stat.S_IMODE((keys / f"{role}.key_secret").stat().st_mode) == 0o600
        # every component was told where its keys are
        for c in rt.children:
            assert c.component is not None and c.component.args[c.component.args.index("--curve-dir") + 1] == str(keys)
        # a peer without keys never completes the handshake: no answer, nothing reaches the planner
        with pytest.raises(TimeoutError, match="no answer"):
            request(rt.planner_endpoint, Kind.STATUS, {}, 1.5, curve=None)
        with pytest.raises(TimeoutError):
            request(rt.planner_endpoint, Kind.SHUTDOWN, {}, 0.5, curve=None)
        # a key the run did not generate is refused too
        from mixplane import wire

        stranger = tmp_path / "stranger"
        wire.ensure_keys(stranger, ("admin",))
        (stranger / "server.key").write_text((keys / "server.key").read_text())  # knows the server's public key
        with pytest.raises(TimeoutError):
            request(rt.planner_endpoint, Kind.SHUTDOWN, {}, 1.0, curve=ControlCurve(str(stranger)))
        # the run's admin key works, and trainers find the client key in the environment the runtime exported
        assert os.environ["MIXPLANE_CURVE_DIR"] == str(keys)
        got = fetch(rt.planner_endpoint, 2, 3)
        assert [int(b["step"]) for b in got[0]] == [0, 1, 2]
        assert status(rt.planner_endpoint, curve=rt.control_curve)["planned_through"] >= 2
        assert not rt.dead()
        # the CLI: --run-dir finds endpoint and keys; without keys it fails with a hint, it does not hang
        r = _cli("status", "--run-dir", str(rt.run_dir), env=_env_without_keys())
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["sources"] == ["a", "b", "c"]
        r = _cli("status", "--planner", rt.planner_endpoint, "--timeout", "1", env=_env_without_keys())
        assert r.returncode == 1 and "--curve-dir" in r.stderr
        r = _cli("status", "--planner", rt.planner_endpoint, "--curve-dir", str(keys), env=_env_without_keys())
        assert r.returncode == 0, r.stderr
        r = _cli("update", "--run-dir", str(rt.run_dir), "--step", "40", "--weight", "a=0.2", env=_env_without_keys())
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["generation"] == 1
        assert not rt.dead()
    assert os.environ.get("MIXPLANE_CURVE_DIR") == before  # restored by stop()


def test_open_on_purpose_runs_without_keys(token_sources, tmp_path):
    spec = parse_spec(token_mixture(token_sources["root"], runtime={"window": 64, "metrics": False, "security": "open"}))
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        assert rt.key_dir is None and not (tmp_path / "run" / "keys").exists()
        assert all("--curve-dir" not in c.component.args for c in rt.children if c.component is not None)
        assert request(rt.planner_endpoint, Kind.STATUS, {}, 10, curve=None)["sources"] == ["a", "b", "c"]
        got = fetch(rt.planner_endpoint, 2, 2)
        assert len(got[1]) == 2
    log = (tmp_path / "run" / "logs")
    assert log.is_dir()


def test_a_new_run_keeps_the_previous_journal(token_sources, tmp_path):
    from mixplane.replay import replay_step

    spec = parse_spec(token_mixture(token_sources["root"]))
    run_dir = tmp_path / "run"
    with EmbeddedRuntime(spec, run_dir) as rt:
        first = fetch(rt.planner_endpoint, 2, 5)
    steps_first = [r["step"] for r in read_journal(run_dir / "journal.jsonl") if r["event"] == "step"]
    assert steps_first[:5] == [0, 1, 2, 3, 4]
    with EmbeddedRuntime(spec, run_dir) as rt:
        fetch(rt.planner_endpoint, 2, 2)
    kept = archived(run_dir / "journal.jsonl")
    assert len(kept) == 1 and os.path.dirname(kept[0]) == str(run_dir / "journals")
    assert [r["step"] for r in read_journal(kept[0]) if r["event"] == "step"] == steps_first
    current = [r for r in read_journal(run_dir / "journal.jsonl")]
    assert sum(r["event"] == "open" for r in current) == 1  # a fresh file, not appended to the old one
    # step 4 was planned only by the first run: replay names the kept journal, and replays from it
    from mixplane.replay import ReplayError

    latest = max(r["step"] for r in current if r["event"] == "step")
    if latest < 4:
        with pytest.raises(ReplayError, match="journals"):
            replay_step(spec, step=4, rank=1, run_dir=str(run_dir))
    out = replay_step(spec, step=4, rank=1, run_dir=str(run_dir), journal=kept[0])
    assert out["digest_match"]
    assert out["tokens_by_source"] == {n: int((first[1][4]["source_ids"] == i).sum()) for i, n in enumerate("abc")}


def test_the_spec_step_timeout_reaches_clients_unless_they_set_their_own(token_sources, tmp_path, monkeypatch):
    monkeypatch.delenv("MIXPLANE_TIMEOUT_S", raising=False)
    spec = parse_spec(token_mixture(token_sources["root"], runtime={"window": 64, "metrics": False, "step_timeout_s": 7.5}))
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        default = MixtureLoader(rt.planner_endpoint, rank=0, max_steps=1)
        own = MixtureLoader(rt.planner_endpoint, rank=1, max_steps=1, timeout_s=33.0)
        assert default.timeout_s == 120.0  # until the planner said otherwise
        for ld in (default, own):
            next(ld)
        assert default.timeout_s == 7.5 and own.timeout_s == 33.0
        default.close()
        own.close()
        monkeypatch.setenv("MIXPLANE_TIMEOUT_S", "44")
        env_set = MixtureLoader(rt.planner_endpoint, rank=0, max_steps=1)
        env_set.next_step = 1
        env_set.max_steps = 2
        next(env_set)
        assert env_set.timeout_s == 44.0
        env_set.close()


def test_restart_policy_backoff_and_budget_are_pure_arithmetic():
    from mixplane.runtime import RestartPolicy

    p = RestartPolicy(budget=3, window_s=60, backoff_s=0.5, backoff_max_s=1.5)
    assert p.delay([], 100.0) == 0.5
    assert p.delay([99.0], 100.0) == 1.0
    assert p.delay([98.0, 99.0], 100.0) == 1.5  # capped
    assert p.delay([97.0, 98.0, 99.0], 100.0) is None  # budget spent within the window
    assert p.delay([10.0, 20.0, 30.0], 100.0) == 0.5  # old restarts no longer count
    # an incarnation that ran stable_s (default 5 s) after it was ready died of something else than its start:
    # restarted at once; one that died sooner (or never got ready) is backed off; the budget still counts
    assert p.delay([], 100.0, ran_s=5.0) == 0.0
    assert p.delay([99.0], 100.0, ran_s=600.0) == 0.0
    assert p.delay([99.0], 100.0, ran_s=4.9) == 1.0
    assert p.delay([], 100.0, ran_s=None) == 0.5
    assert p.delay([97.0, 98.0, 99.0], 100.0, ran_s=600.0) is None
    assert RestartPolicy(stable_s=1.0).delay([], 0.0, ran_s=1.5) == 0.0


def test_a_killed_loader_is_restarted_until_its_budget_is_spent(token_sources, tmp_path):
    import signal
    import time

    from mixplane.runtime import ComponentFailed, RestartPolicy

    spec = parse_spec(token_mixture(token_sources["root"]))
    with EmbeddedRuntime(spec, tmp_path / "ref") as rt:
        ref = fetch(rt.planner_endpoint, 2, 4)
    policy = RestartPolicy(budget=1, window_s=600, backoff_s=0.2, roles=("loader",))
    with EmbeddedRuntime(spec, tmp_path / "run", restart=policy) as rt:
        victim = next(c for c in rt.children if c.name == "loader-b-0")
        old_pid = victim.proc.pid
        os.kill(old_pid, signal.SIGKILL)  # before any step was asked for: nothing of it was in flight
        victim.proc.wait(10)
        restarted: list[str] = []
        deadline = time.monotonic() + 60
        while not restarted and time.monotonic() < deadline:
            restarted = rt.supervise()
            time.sleep(0.05)
        assert restarted == ["loader-b-0"]
        fresh = next(c for c in rt.children if c.name == "loader-b-0")
        assert fresh.proc.pid != old_pid and fresh.proc.poll() is None and len(fresh.restarts) == 1
        assert json.loads((tmp_path / "run" / "endpoints.json").read_text())["components"]["loader-b-0"]["pid"] == fresh.proc.pid
        got = fetch(rt.planner_endpoint, 2, 4)  # the restarted loader re-registered and serves from the planner's cursor
        for r in (0, 1):
            for a, b in zip(ref[r], got[r]):
                assert all((a[k] == b[k]).all() for k in a)
        # the second death spends the budget: a clear error naming the component
        os.kill(fresh.proc.pid, signal.SIGKILL)
        fresh.proc.wait(10)
        with pytest.raises(ComponentFailed, match=r"loader-b-0 exited with code -9 and was restarted 1 times.*budget"):
            rt.supervise()
        # roles the policy does not cover fail at once
        planner = next(c for c in rt.children if c.name == "planner")
        os.kill(planner.proc.pid, signal.SIGKILL)
        planner.proc.wait(10)
        with pytest.raises(ComponentFailed, match="^planner exited with code -9; see"):
            rt.supervise()
    with EmbeddedRuntime(spec, tmp_path / "plain") as rt:  # no policy: any death is a failure
        c = next(c for c in rt.children if c.name == "loader-a-0")
        os.kill(c.proc.pid, signal.SIGKILL)
        c.proc.wait(10)
        with pytest.raises(ComponentFailed, match="loader-a-0 exited with code -9; see"):
            rt.supervise()


def test_two_runtimes_in_one_process_share_keys_so_one_environment_reaches_both(token_sources, tmp_path):
    spec = parse_spec(token_mixture(token_sources["root"]))
    with EmbeddedRuntime(spec, tmp_path / "one") as one:
        with EmbeddedRuntime(spec, tmp_path / "two") as two:
            for role in ("server", "client", "admin", "component"):
                assert (one.key_dir / f"{role}.key_secret").read_bytes() == (two.key_dir / f"{role}.key_secret").read_bytes()
            assert stat.S_IMODE((two.key_dir / "admin.key_secret").stat().st_mode) == 0o600
            a = fetch(one.planner_endpoint, 2, 2)
            b = fetch(two.planner_endpoint, 2, 2)
        later = []
        for r in (0, 1):  # still reachable after the second one stopped
            ld = MixtureLoader(one.planner_endpoint, rank=r, timeout_s=60, max_steps=3)
            ld.next_step = 2
            later.append([int(x["step"]) for x in ld])
            ld.close()
    assert later == [[2], [2]]
    for r in (0, 1):
        assert all((x[k] == y[k]).all() for x, y in zip(a[r], b[r]) for k in x)  # same spec, same batches
