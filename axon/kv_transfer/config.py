"""``--kv-transfer-config``: vLLM's keys, checked once at start-up with errors that name the key."""

from __future__ import annotations

import difflib
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

CONNECTORS = ("NixlConnector", "SharedStorageConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("recompute", "fail")
# vLLM's keys that axon reads, and the ones it accepts and ignores (they configure transports
# axon does not have: the v0 P2P connectors' ranks and ports, the staging buffer's device).
_KEYS = {"kv_connector", "kv_role", "kv_load_failure_policy", "kv_connector_extra_config", "engine_id"}
_IGNORED_KEYS = {
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_connector_module_path",
}


@dataclass(frozen=True)
class KVTransferSettings:
    kv_connector: str
    kv_role: str
    kv_load_failure_policy: str = "recompute"
    # This server's id in kv_transfer_params (remote_engine_id); a random one by default.
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra_number(self, key: str, default: float) -> float:
        value = self.extra.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(
                f"kv_transfer_config.kv_connector_extra_config.{key} must be a number >= 0, got {value!r}."
            )
        return float(value)


def check_keys(name: str, raw: dict[str, Any], known: list[str], ignored: Collection[str] = ()) -> None:
    """Refuse a key of the JSON object ``name`` that is not ``known`` (nor ``ignored``), with
    the closest known key or, failing one, the list."""
    for key in raw:
        if key not in known and key not in ignored:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f" (known keys: {', '.join(known)})"
            raise ValueError(f"{name} has an unknown key {key!r}{hint}")


def parse_kv_transfer_config(raw: dict[str, Any] | None) -> KVTransferSettings | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"kv_transfer_config must be a JSON object, got {raw!r}.")  # noqa: TRY004
    check_keys("kv_transfer_config", raw, sorted(_KEYS), ignored=_IGNORED_KEYS)
    connector = raw.get("kv_connector")
    if connector not in CONNECTORS:
        raise ValueError(
            f"kv_transfer_config.kv_connector must be one of {', '.join(CONNECTORS)}, got {connector!r}."
        )
    role = raw.get("kv_role")
    if role not in ROLES:
        raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(ROLES)}, got {role!r}.")
    policy = raw.get("kv_load_failure_policy", "recompute")
    if policy not in FAILURE_POLICIES:
        raise ValueError(
            f"kv_transfer_config.kv_load_failure_policy must be one of {', '.join(FAILURE_POLICIES)}, got {policy!r}."
        )
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(  # noqa: TRY004
            f"kv_transfer_config.kv_connector_extra_config must be a JSON object, got {extra!r}."
        )
    engine_id = raw.get("engine_id")
    if engine_id is not None and not (isinstance(engine_id, str) and engine_id):
        raise ValueError(f"kv_transfer_config.engine_id must be a non-empty string, got {engine_id!r}.")
    given = {} if engine_id is None else {"engine_id": engine_id}  # else a new random one
    return KVTransferSettings(connector, role, policy, extra=dict(extra), **given)
