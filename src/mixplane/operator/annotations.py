"""The operator's inputs that are not part of the data plane's spec, read from the DataMixture's `mixplane.io/*`
annotations once per pass into one frozen typed object, so a bad value is refused by name in one place.

What the operator READS from the DataMixture is `READ` below (docs/operator.md's annotation table is checked against
it). Every other `mixplane.io/*` key the operator names is not an input of the mixture: `NOT_INPUTS` says what each
is (tests/unit/test_operator_annotations.py finds every such key in the operator's source and holds it to one list
or the other).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from mixplane.errors import MixplaneError
from mixplane.operator.autopartition import LoaderBudget

ANN_TPS = "mixplane.io/tokens-per-second"
ANN_CPU = "mixplane.io/loader-cpu"
ANN_MEMORY = "mixplane.io/loader-memory"
ANN_PROFILE = "mixplane.io/profile"
ANN_PROFILER = "mixplane.io/profiler"
ANN_SCALE_ON = "mixplane.io/scale-on"
ANN_SCALE_COSTS = "mixplane.io/scale-costs"
ANN_REPARTITION = "mixplane.io/repartition"
DEFAULT_TPS = 1e6
DEFAULT_CPU = 64.0
DEFAULT_MEMORY = 256 << 30


@dataclass(frozen=True)
class Annotation:
    """One annotation the operator reads: its key, its default as the documentation writes it, what it means."""

    key: str
    default: str
    meaning: str


# the annotations of a DataMixture the operator reads, in docs/operator.md's order
READ: tuple[Annotation, ...] = (
    Annotation(ANN_TPS, "1e6", "the trainer's consumption: what loaders are sized for"),
    Annotation(ANN_CPU, "64", "cores all loader pods may request"),
    Annotation(ANN_MEMORY, "256 GiB", "bytes all loader pods may request"),
    Annotation(ANN_PROFILE, "—", "a `mixplane profile` JSON, when the operator cannot read the sources itself"),
    Annotation(ANN_PROFILER, "auto", "where sources are profiled when neither the status nor the annotation has a "
               "profile: `auto` (a Job under `kubernetes.source_secret` or when in-process fails, else in-process), "
               "`job`, `operator`"),
    Annotation(ANN_SCALE_ON, "measured", "`measured`: scaling follows the trainer token rate the planner sees; "
               "`declared`: it keeps `tokens-per-second`"),
    Annotation(ANN_SCALE_COSTS, "measured", "`measured`: a source the planner waited for has its cost per token "
               "corrected by what it delivered; `profiled`: the profile's costs are used as they are"),
    Annotation(ANN_REPARTITION, "grow", "`grow`: a source is re-partitioned to more partitions when its allocation "
               "needs them, never to fewer; `follow`: also to fewer once nothing needs them"),
)


# the operator's other mixplane.io/* keys: its bookkeeping on its own children, labels, and what users set on pods
NOT_INPUTS: dict[str, str] = {
    "mixplane.io/partitions": "annotation the operator writes on a loader Deployment: the partitions it hosts",
    "mixplane.io/host": "annotation the operator writes on a loader Deployment: its name in the planner's table",
    "mixplane.io/shadow-of": "annotation the operator writes on a shadow loader Deployment: the primary host",
    "mixplane.io/spec-hash": "annotation the operator writes on its pod templates: restarts on a spec change",
    "mixplane.io/profile-sources": "annotation the operator writes on a profiling Job: the sources it profiles",
    "mixplane.io/injected": "annotation the pod webhook writes on a trainer pod it mutated (never twice)",
    "mixplane.io/instance": "label of the operator's children: the mixture they belong to",
    "mixplane.io/role": "label of the operator's children: planner, loader, constructor",
    "mixplane.io/component": "label of the operator's children: the component's name",
    "mixplane.io/metrics": "label of the Services a ServiceMonitor scrapes",
    "mixplane.io/loader-group": "label of a primary loader and its shadows (spread over nodes)",
    "mixplane.io/profile-of": "label of profiling Jobs and their pods",
    "mixplane.io/profile-digest": "label of profiling Jobs: the spec and options they profile",
    "mixplane.io/operator": "the finalizer kopf keeps on a DataMixture",
    "mixplane.io/mixture": "label users put on trainer pods: the mixture the pod webhook joins them to",
    "mixplane.io/trainer-index": "label or annotation users put on trainer pods: the pod's slot (webhooks.trainer_index)",
}


class ReconcileError(MixplaneError, ValueError):
    """The object cannot be turned into children; the message names the field or annotation. (Defined here, where
    the operator first reads the object, so that a bad annotation is one; operator.reconcile re-exports it.)"""


@dataclass(frozen=True)
class MixtureAnnotations:
    """What a DataMixture's annotations ask of the operator (the defaults: none given)."""

    tokens_per_s: float = DEFAULT_TPS  # what loaders are sized for (and scaled on under scale-on: declared)
    budget: LoaderBudget = LoaderBudget(DEFAULT_CPU, DEFAULT_MEMORY)  # what all loader pods may request
    scale_on: Literal["measured", "declared"] = "measured"
    scale_costs: Literal["measured", "profiled"] = "measured"
    repartition: Literal["grow", "follow"] = "grow"
    profiler: Literal["auto", "job", "operator"] = "auto"
    profile: dict[str, Any] | None = None  # a profile given by hand, each source marked measured_by: annotation

    def profiler_for(self, spec: Any) -> Literal["job", "operator", "auto"]:
        """Where to profile: `job` (a pod with the loaders' image and storage credentials), `operator` (in-process,
        as the operator's own identity), or `auto`: a Job when the loaders' credentials are a Secret the operator
        must not hold (kubernetes.source_secret), else in-process with a Job when that fails."""
        return "job" if self.profiler == "auto" and spec.kubernetes.source_secret else self.profiler


def _where(key: str) -> str:
    return f"metadata.annotations.{key}"


def _positive(ann: Mapping[str, Any], key: str, default: float) -> float:
    raw = ann.get(key)
    if raw is None:
        return default
    try:
        x = float(raw)
    except (TypeError, ValueError):
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise ReconcileError(f"{_where(key)}: expected a number > 0, got {raw!r}")
    return x


def _choice(ann: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> Any:
    raw = ann.get(key, choices[0])
    if raw not in choices:
        raise ReconcileError(f"{_where(key)}: expected {', '.join(choices[:-1])} or {choices[-1]}, got {raw!r}")
    return raw


def _profile(ann: Mapping[str, Any]) -> Any:
    raw = ann.get(ANN_PROFILE)
    if raw is None:
        return None
    try:
        prof = json.loads(raw)
    except (TypeError, json.JSONDecodeError) as e:
        raise ReconcileError(f"{_where(ANN_PROFILE)}: not JSON ({e})") from None
    if isinstance(prof, dict) and isinstance(prof.get("sources"), dict):
        prof = {**prof, "sources": {n: {**p, "measured_by": "annotation"} if isinstance(p, dict) else p
                                    for n, p in prof["sources"].items()}}
    return prof


def annotations_of(body: Mapping[str, Any]) -> MixtureAnnotations:
    """Parse every annotation in `READ` from a DataMixture object; ReconcileError names the first bad one."""
    ann = (body.get("metadata") or {}).get("annotations") or {}
    return MixtureAnnotations(
        tokens_per_s=_positive(ann, ANN_TPS, DEFAULT_TPS),
        budget=LoaderBudget(_positive(ann, ANN_CPU, DEFAULT_CPU), int(_positive(ann, ANN_MEMORY, DEFAULT_MEMORY))),
        scale_on=_choice(ann, ANN_SCALE_ON, ("measured", "declared")),
        scale_costs=_choice(ann, ANN_SCALE_COSTS, ("measured", "profiled")),
        repartition=_choice(ann, ANN_REPARTITION, ("grow", "follow")),
        profiler=_choice(ann, ANN_PROFILER, ("auto", "job", "operator")),
        profile=_profile(ann),
    )
