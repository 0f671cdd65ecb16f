"""What a profile is on the wire between a profiling Job's pod and the operator: the slim profile, its bound in
a termination message, the redacted error, and their parser; the auto-partitioner's inputs from a profile.

Pure (no loader, no I/O): the operator's builders and reconcile import it; `mixplane.profile`, which measures
sources through the loader, re-exports it."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mixplane.errors import MixplaneError
from mixplane.imagedecode import ImageCosts

PROFILE_VERSION = 1
# bytes of a container's termination message the kubelet keeps: a profiling Job's pod hands its result back there
TERMINATION_LIMIT = 4096
# what the auto-partitioner needs of a source; the rest of a profile stays in the pod's log
SLIM_FIELDS = ("cpu_s_per_token", "memory_per_partition", "max_partitions", "mean_tokens_per_sample")
# environment variables whose values never leave a profiling pod (storage credentials from kubernetes.source_secret)
_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSW|CREDENTIAL|SESSION|AUTH|SIGNATURE", re.IGNORECASE)


class PartitionError(MixplaneError, ValueError):
    """The mixture cannot be served within the budget; the message names the source, segment and resource."""


@dataclass(frozen=True)
class SourceCost:
    """What one source costs to serve: measured by `mixplane profile`, never guessed."""

    name: str
    cpu_s_per_token: float  # CPU seconds per delivered token (page read + decode + transform)
    memory_per_partition: int  # bytes one Source Loader of this source holds (buffers + file access state)
    max_partitions: int = 1 << 20  # data-parallel bound (e.g. row groups or files of the source)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cpu_s_per_token) and self.cpu_s_per_token >= 0):
            raise PartitionError(f"source {self.name}: cpu_s_per_token must be a finite number >= 0, got {self.cpu_s_per_token}")
        if self.memory_per_partition < 0:
            raise PartitionError(f"source {self.name}: memory_per_partition must be >= 0, got {self.memory_per_partition}")
        if self.max_partitions < 1:
            raise PartitionError(f"source {self.name}: max_partitions must be >= 1, got {self.max_partitions}")


def _g6(x: float) -> float:
    return float(f"{x:.6g}")


def slim_profile(profile: Mapping[str, Any]) -> dict[str, Any]:
    """A profile with only what the auto-partitioner reads, the files listed (what tells the operator the profile's
    max_partitions counts a block-read source's blocks: `operator.reconcile.profile_from_status`) and an image source's
    image costs (what the operator resolves `image.decode_at: auto` from), six significant digits: what fits a
    termination message."""
    out: dict[str, dict[str, Any]] = {}
    for name, p in profile["sources"].items():
        out[name] = {"cpu_s_per_token": _g6(p["cpu_s_per_token"]), "memory_per_partition": int(p["memory_per_partition"]),
                     "max_partitions": int(p["max_partitions"]), "mean_tokens_per_sample": _g6(p["mean_tokens_per_sample"])}
        if p.get("files_listed"):  # kept with max_partitions: a profile that says its file count knows block reading
            out[name]["files_listed"] = int(p["files_listed"])
        ic = p.get("image_costs")
        if isinstance(ic, Mapping):
            out[name]["image_costs"] = {k: _g6(ic[k]) for k in IMAGE_COST_FIELDS[:3]} | {"images": int(ic["images"])}
    return {"version": PROFILE_VERSION, "sources": out}


# an image source's measured image costs in a profile (`image_costs`), per image: what `decode_at: auto` decides from
IMAGE_COST_FIELDS = ("decode_s", "raw_bytes", "decoded_bytes", "images")


def image_costs_from_profile(profile: Mapping[str, Any]) -> dict[str, ImageCosts]:
    """Source -> its measured image costs, for the sources whose profile has them (`image_costs`)."""
    out = {}
    for name, p in (profile.get("sources") or {}).items():
        ic = p.get("image_costs") if isinstance(p, Mapping) else None
        if not isinstance(ic, Mapping):
            continue
        try:
            out[str(name)] = ImageCosts(float(ic["decode_s"]), float(ic["raw_bytes"]), float(ic["decoded_bytes"]),
                                        int(ic["images"]))
        except (KeyError, TypeError, ValueError) as e:
            raise PartitionError(f"profile sources.{name}.image_costs: {e}") from None
    return out


def _compact(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def slim_entry_bound(name: str, image: bool = False) -> int:
    """Bytes one source takes at most in a slim profile's message (the widest numbers each field can have);
    `image`: an image source, with its image costs."""
    widest: dict[str, Any] = {"cpu_s_per_token": -1.23457e-100, "memory_per_partition": 1 << 63, "max_partitions": 1 << 63,
                              "mean_tokens_per_sample": -1.23457e-100, "files_listed": 1 << 63}
    if image:
        widest["image_costs"] = {"decode_s": -1.23457e-100, "raw_bytes": -1.23457e-100, "decoded_bytes": -1.23457e-100,
                                 "images": 1 << 63}
    return len(_compact({name: widest})) - 1  # minus one of the braces; the comma between entries takes its place


def message_envelope() -> int:
    """Bytes of a slim profile's message besides its sources."""
    return len(_compact({"version": PROFILE_VERSION, "sources": {}}))


def termination_message(profile: Mapping[str, Any]) -> str:
    """The slim profile as a profiling pod's termination message; ValueError when it would not fit (the operator
    gives each pod few enough sources that it always does)."""
    text = _compact(slim_profile(profile))
    if len(text.encode()) > TERMINATION_LIMIT:
        raise ValueError(f"the profile of {len(profile['sources'])} sources takes {len(text.encode())} bytes, more than "
                         f"the {TERMINATION_LIMIT} a termination message holds; profile fewer sources (--sources)")
    return text


def redact(text: str, environ: Mapping[str, str]) -> str:
    """`text` without the value of any environment variable named like a credential (KEY, SECRET, TOKEN, ...): an
    error a storage client raises must not carry a Secret's value into the operator's status."""
    for k, v in environ.items():
        if v and len(v) >= 4 and _SECRET_NAME.search(k):
            text = text.replace(v, "***")
    return text


def error_message(error: str, environ: Mapping[str, str]) -> str:
    """A failed profile's termination message: the error, redacted, cut to fit."""
    text = redact(error, environ)
    out = _compact({"version": PROFILE_VERSION, "error": text})
    while len(out) > TERMINATION_LIMIT:  # ASCII (json escapes the rest): characters are bytes
        text = text[: len(text) - max(16, len(out) - TERMINATION_LIMIT)]
        out = _compact({"version": PROFILE_VERSION, "error": text + "..."})
    return out


def parse_message(text: str) -> dict[str, Any]:
    """A profiling pod's termination message: the slim profile, or {"error": ...}; ValueError when it is neither."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != PROFILE_VERSION:
        raise ValueError(f"not a mixplane profile message (version {PROFILE_VERSION})")
    if "error" in doc:
        return {"error": str(doc["error"])}
    costs_from_profile(doc)  # every source with the fields the auto-partitioner needs
    for name, p in doc["sources"].items():
        if not (isinstance(p.get("mean_tokens_per_sample"), (int, float)) and p["cpu_s_per_token"] >= 0
                and p["memory_per_partition"] >= 0 and p["max_partitions"] >= 1
                and (type(p.get("files_listed", 1)) is int and p.get("files_listed", 1) >= 1)):
            raise ValueError(f"sources.{name}: figures out of range")
    try:
        costs = image_costs_from_profile(doc)
    except PartitionError as e:
        raise ValueError(str(e)) from None
    for name, c in costs.items():
        if not all(math.isfinite(x) and x >= 0 for x in (c.decode_s, c.raw_bytes, c.decoded_bytes)) or c.images < 0:
            raise ValueError(f"sources.{name}.image_costs: figures out of range")
    return doc


def costs_from_profile(profile: dict[str, Any]) -> list[Any]:
    """The auto-partitioner's inputs from a profile (as printed, or kept in the status)."""
    if not isinstance(profile, dict) or profile.get("version") != PROFILE_VERSION or not isinstance(profile.get("sources"), dict):
        raise PartitionError(f"not a mixplane profile (version {PROFILE_VERSION}): expected {{version, sources}}")
    out = []
    for name, p in profile["sources"].items():
        try:
            out.append(SourceCost(name, float(p["cpu_s_per_token"]), int(p["memory_per_partition"]), int(p.get("max_partitions", 1 << 20))))
        except (KeyError, TypeError, ValueError) as e:
            raise PartitionError(f"profile sources.{name}: {e}") from None
    return out
