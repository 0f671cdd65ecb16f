"""The mixture's CURVE key pairs: read from its Secret (never rotated by a reconcile: running pods hold them),
issued for a new mixture or for trainer pods a grown world adds, and the operator's own admin key directory."""

from __future__ import annotations

import base64
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mixplane.operator.builders import ROLES

_PUBLIC = re.compile(r'public-key = "([^"]+)"')
_SECRET = re.compile(r'secret-key = "([^"]+)"')


def existing_keys(secret: Mapping[str, Any] | None) -> dict[str, tuple[str, str]] | None:
    """Key pairs of an existing Secret, the roles' and the trainer pods' (never rotated by a reconcile: running pods
    hold them); None when a role's pair is missing or unreadable."""
    from mixplane.wire import SECRET_SUFFIX, ranks_of_key_name

    if not secret:
        return None
    data = secret.get("data") or {}
    out = {}
    names = [*ROLES, *sorted(n[: -len(SECRET_SUFFIX)] for n in data if n.endswith(SECRET_SUFFIX)
                             and ranks_of_key_name(n[: -len(SECRET_SUFFIX)]) is not None)]
    for name in names:
        raw = data.get(f"{name}{SECRET_SUFFIX}")
        if raw is None:
            return None
        try:
            text = base64.b64decode(raw, validate=True).decode()
        except ValueError:  # not base64, not text (binascii.Error and UnicodeDecodeError): unreadable like a bad pair
            text = ""
        pub, sec = _PUBLIC.search(text), _SECRET.search(text)
        if not pub or not sec:
            if name in ROLES:
                return None
            continue  # a damaged pod key is issued again
        out[name] = (pub.group(1), sec.group(1))
    return out


def new_keys(names: tuple[str, ...] = ROLES) -> dict[str, tuple[str, str]]:
    import zmq

    out = {}
    for name in names:
        pub, sec = zmq.curve_keypair()
        out[name] = (pub.decode(), sec.decode())
    return out


def with_pod_keys(keys: Mapping[str, tuple[str, str]], pod_keys: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """The roles' pairs and exactly the trainer pods' pairs `pod_keys` (kept where the Secret has them, new where
    it does not: a world that grew adds pods; pairs of pods the mixture no longer has are dropped)."""
    out = {r: keys[r] for r in ROLES}
    missing = tuple(n for n in pod_keys if n not in keys)
    fresh = new_keys(missing) if missing else {}
    out.update({n: keys[n] if n in keys else fresh[n] for n in pod_keys})
    return out


def admin_key_dir(name: str, namespace: str, keys: Mapping[str, tuple[str, str]]) -> str:
    """A private key dir (0700) with the admin pair and the server's public key, for control requests."""
    from mixplane.operator.builders import cert_text

    d = Path(tempfile.gettempdir()) / f"mixplane-operator-{os.getuid()}" / f"{namespace}.{name}"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    (d / "server.key").write_text(cert_text(keys["server"][0]))
    sec = d / "admin.key_secret"
    sec.touch(mode=0o600)
    sec.write_text(cert_text(*keys["admin"]))
    (d / "admin.key").write_text(cert_text(keys["admin"][0]))
    return str(d)




def keys_for(secret: Mapping[str, Any] | None, pod_keys: tuple[str, ...] | None = None) -> dict[str, tuple[str, str]]:
    """The Secret's key pairs (new ones for a new mixture); with `pod_keys`, completed with the trainer pods' keys."""
    keys = existing_keys(secret) or new_keys()
    return keys if pod_keys is None else with_pod_keys(keys, pod_keys)


def stale_trainer_keys(secret_data: Mapping[str, Any] | None, wanted: tuple[str, ...]) -> list[str]:
    """Entries of a key Secret's data for trainer pods the world served no longer has (`client-r<A>-<B>.key` and
    `.key_secret`), to remove once a topology change is acknowledged (server-side apply of stringData leaves them)."""
    from mixplane.wire import ranks_of_key_name

    keep = set(wanted)
    out = []
    for item in secret_data or {}:
        name = str(item).split(".", 1)[0]
        if ranks_of_key_name(name) is not None and name not in keep:
            out.append(str(item))
    return sorted(out)
