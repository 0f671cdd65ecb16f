"""The operator on sources of many files: what it writes (status, ConfigMaps) does not grow with the file count, and a
status that would take the object past the API server's size is a condition (StatusTooLarge), not a failed patch."""

from __future__ import annotations

import copy
import json

from mixplane.operator.controller import decide, status_patch
from mixplane.operator.reconcile import (
    ETCD_REQUEST_LIMIT, OBJECT_BUDGET_BYTES, SIZE_CONDITION, bounded_patch, fit_status, object_bytes,
)
from tests.unit.test_operator_controller import PROFILE, body, observed


def _cond(status):
    return next((c for c in status.get("conditions") or [] if c["type"] == SIZE_CONDITION), None)


def _decided(profile_max_partitions: int | None, files_listed: int):
    prof = copy.deepcopy(PROFILE)
    for p in prof["sources"].values():
        if profile_max_partitions is not None:
            p["max_partitions"] = profile_max_partitions
        # what a sampled profile adds (mixplane profile's full output): must not reach the status
        p.update({"files_listed": files_listed, "files_sampled": 64, "sampled": True, "index_bytes_per_file": 3000.0})
    obs = observed(body())
    obs = type(obs)(**{**obs.__dict__, "profile": prof})
    return decide(obs)


def test_status_and_configmaps_do_not_grow_with_the_file_count():
    """A source of 100,000 files profiles to max_partitions ~10^6 (pages): the plan, the status and every ConfigMap
    are the same as for a source of 100 files whose page count does not bound the plan."""
    few, many = _decided(2_000, 100), _decided(1_000_000, 100_000)
    assert many.desired.plan.partitions == few.desired.plan.partitions
    s_few, s_many = json.dumps(few.status, sort_keys=True), json.dumps(many.status, sort_keys=True)
    assert abs(len(s_many) - len(s_few)) <= 2 * len(many.status["sources"]) * 4  # only maxPartitions' and filesListed's digits
    assert not any(k in s_many for k in ("files_listed", "files_sampled", "index_bytes_per_file", "sampled"))
    cms = {o["metadata"]["name"]: json.dumps(o) for o in many.desired.objects if o["kind"] == "ConfigMap"}
    cms_few = {o["metadata"]["name"]: json.dumps(o) for o in few.desired.objects if o["kind"] == "ConfigMap"}
    assert cms.keys() == cms_few.keys() and cms
    assert all(len(cms[n]) == len(cms_few[n]) for n in cms)
    assert json.dumps(many.intent) == json.dumps(few.intent)
    assert object_bytes(body(), many.status) < 64 << 10


def _grown(slots: int) -> dict:
    """A full status with its informational fields grown: `slots` sidecar slots, 20 scaling records, histories."""
    st = _decided(None, 100).status
    st["sidecars"] = [{"slot": k, "pods": [f"loader-web-{k}-{j}" for j in range(4)],
                       "partitions": ",".join(f"web:{4 * k + j}" for j in range(4)), "cpu": 1.0} for k in range(slots)]
    st["scaling"] = [{"step": i, "source": "web", "direction": "up", "fromCores": 1.0, "toCores": 2.0, "interval": 30,
                      "time": "2026-11-27T14:00:00Z", "loaderPods": 3} for i in range(20)]
    st["updates"] = [{"generation": g, "updateId": f"u{g}", "effectiveStep": g * 10} for g in range(20)]
    return st


def test_a_status_within_the_bound_is_written_whole():
    st = _decided(None, 100).status
    patch, fitted = bounded_patch(body(), {}, st)
    assert fitted.fits and not fitted.dropped and patch == status_patch({}, st) and _cond(patch) is None


def test_informational_fields_are_left_out_first_and_the_condition_says_which():
    b = body()
    st = _grown(slots=12_000)  # ~1.3 MB of sidecar records: over the bound, under etcd's limit without them
    assert object_bytes(b, st) > OBJECT_BUDGET_BYTES
    patch, fitted = bounded_patch(b, {}, st)
    assert fitted.fits and fitted.dropped == ("sidecars",)
    assert "sidecars" not in patch and patch["scaling"] == st["scaling"] and patch["sources"] == st["sources"]
    cond = _cond(patch)
    assert cond["status"] == "True" and cond["reason"] == "Trimmed" and "sidecars" in cond["message"]
    assert str(ETCD_REQUEST_LIMIT) in cond["message"] and str(fitted.bytes_before) in cond["message"]
    # the conditions the pass wrote are kept beside it; the object is within the bound
    assert {c["type"] for c in patch["conditions"]} >= {"Ready", "Progressing", "Degraded", SIZE_CONDITION}
    assert object_bytes(b, {**patch}) <= OBJECT_BUDGET_BYTES
    # stored sidecars are removed by the patch (a merge patch's null), and the next pass keeps the condition's time
    stored = {**st, "conditions": patch["conditions"]}
    again, _ = bounded_patch({**b, "status": stored}, stored, st)
    assert again["sidecars"] is None
    assert "conditions" not in again  # the condition stays as stored, its lastTransitionTime with it


def test_what_a_pass_reads_back_is_never_left_out():
    b = body()
    st = _grown(slots=200)
    fitted = fit_status(b, st, budget=object_bytes(b, {}) + 600)  # far too small: everything informational goes
    assert not fitted.fits
    assert fitted.dropped[:2] == ("sidecars", "scaling") and "updates but its last entry" in fitted.dropped
    kept = fitted.status
    assert kept["updates"] == st["updates"][-1:]
    for s in kept["sources"]:
        assert {"name", "partitions", "startPartitions", "profile"} <= set(s) and "targetWeight" not in s
    for key in ("layout", "children", "mixtureUpdate", "conditions", "phase", "step"):
        assert (key in kept) == (key in st)


def test_a_status_that_cannot_fit_writes_only_the_condition():
    b = body()
    b["metadata"]["annotations"]["mixplane.io/profile"] = "x" * (OBJECT_BUDGET_BYTES + 10)  # the object itself too large
    st = _decided(None, 100).status
    patch, fitted = bounded_patch(b, {"phase": "Running"}, st)
    assert not fitted.fits and set(patch) == {"conditions"}
    cond = _cond(patch)
    assert cond["status"] == "True" and cond["reason"] == "OverLimit" and "not written" in cond["message"]


def test_the_condition_clears_once_the_status_fits_again():
    b = body()
    patch, _ = bounded_patch(b, {}, _grown(slots=12_000))
    stored = {k: v for k, v in patch.items() if v is not None}
    small = _decided(None, 100).status  # the pass's own conditions do not carry StatusTooLarge
    patch2, fitted = bounded_patch({**b, "status": stored}, stored, small)
    assert fitted.fits and not fitted.dropped
    cond = _cond(patch2)
    assert cond["status"] == "False" and cond["reason"] == "WithinLimit"
