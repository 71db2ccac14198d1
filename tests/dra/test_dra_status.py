"""The status document's ``dra`` section (`nri_plugin.daemon.status.dra_status`) read from a real
`DraFrontDoor` serving its sockets in a tmp dir, with the independent fake kubelet registering it (or
refusing it): its publisher failing for want of credentials (a kubeconfig that is not there, no API
server needed), or not publishing at all; prepared claims counted from the CDI dir. Every section is
checked against the schema (docs/status.schema.json), and the table's DRA block read back."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
from fake_kubelet_dra import FakeKubeletDra
from redteam_support import short_directory, within
from wait_support import wait_until

from nri_plugin.daemon.status import dra_status
from nri_plugin.daemon.status_client import render_table
from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.dra import cdi
from nri_plugin.dra.config import DraConfig
from nri_plugin.dra.frontdoor import DraFrontDoor

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "status.schema.json").read_text())
DRIVER = "shared-cpus.mixed-cpu.openshift.io"
NODE = "node-1"


def validated(section: dict[str, Any]) -> dict[str, Any]:
    """The section, checked against the schema's ``dra`` (and as part of a whole document)."""
    jsonschema.Draft202012Validator(SCHEMA["properties"]["dra"]).validate(section)
    return section


@asynccontextmanager
async def front_door(root: Path, **config: Any) -> AsyncIterator[DraFrontDoor]:
    for name in ("reg", "plugins"):
        (root / name).mkdir()
    settings = DraConfig(
        enabled=True,
        registry_dir=PurePosixPath(root / "reg"),
        plugins_dir=PurePosixPath(root / "plugins"),
        cdi_dir=PurePosixPath(root / "cdi"),
        node_name=NODE,
        kubeconfig=str(root / "absent-kubeconfig"),
        **config,
    )
    door = DraFrontDoor(settings, HostKey(os.urandom(32)), node_name=NODE, device_count=4)
    await door.start()
    try:
        yield door
    finally:
        await door.close()


async def test_registered_failing_to_publish_and_claims_prepared() -> None:
    with short_directory("drast-") as root:
        async with front_door(root) as door:
            # Before kubelet: not registered, and the publisher's first attempt fails (no kubeconfig).
            await wait_until(
                lambda: door.publisher is not None and door.publisher.failures >= 1, what="a failure"
            )
            section = validated(dra_status(door))
            assert (section["enabled"], section["driver"], section["node"]) == (True, DRIVER, NODE)
            assert section["kubelet"] == {
                "registered": False,
                "registrations": 0,
                "last_error": None,
                "registration_socket": str(root / "reg" / f"{DRIVER}-reg.sock"),
                "endpoint": str(root / "plugins" / DRIVER / "dra.sock"),
            }
            slices = section["resource_slices"]
            assert (slices["published_here"], slices["published"], slices["generation"]) == (
                True,
                False,
                None,
            )
            assert slices["devices"] == 4
            assert slices["failures"] >= 1
            assert "absent-kubeconfig" in slices["last_error"]
            assert section["prepared_claims"] == {"count": 0, "capped": False, "read_error": None}

            kubelet = FakeKubeletDra(root / "reg")
            try:
                [socket] = kubelet.registration_sockets()
                await within(kubelet.register(socket))
                await wait_until(lambda: door.registered, what="the registration")
                (root / "cdi").mkdir()  # as the first prepare makes it; the names are what count
                for uid in ("11111111-0000-4000-8000-000000000000", "22222222-0000-4000-8000-000000000000"):
                    cdi.spec_path(root / "cdi", uid).write_text("{}")
                section = validated(dra_status(door))
                assert section["kubelet"]["registered"] is True
                assert section["kubelet"]["registrations"] == 1
                assert section["prepared_claims"]["count"] == 2

                table = render_table(_document(section)).splitlines()
                start = table.index(f"DRA            {DRIVER} on node {NODE}")
                assert table[start + 1] == "  kubelet      registered (1 registration)"
                assert table[start + 2].startswith("  slices       NOT published (")
                assert "absent-kubeconfig" in table[start + 2]
                assert table[start + 3] == "  claims       2 prepared"

                # kubelet refuses it (another plugin holds the name, say): its word is shown.
                await within(kubelet.notify(socket, False, "driver name already registered"))
                section = validated(dra_status(door))
                assert section["kubelet"]["registered"] is False
                assert section["kubelet"]["last_error"] == "driver name already registered"
                table = render_table(_document(section)).splitlines()
                assert "  kubelet      REFUSED (1 registration): driver name already registered" in table
            finally:
                await kubelet.close()


async def test_not_publishing_says_so_and_off_is_all_null() -> None:
    with short_directory("drast-") as root:
        async with front_door(root, publish_resource_slices=False) as door:
            section = validated(dra_status(door))
            assert section["resource_slices"] == {
                "published_here": False,
                "published": None,
                "generation": None,
                "devices": None,
                "failures": None,
                "last_error": None,
                "restores": None,
            }
            table = render_table(_document(section)).splitlines()
            assert "  slices       not published by this daemon (publish_resource_slices = false)" in table
    assert validated(dra_status(None)) == {
        "enabled": False,
        "driver": None,
        "node": None,
        "kubelet": None,
        "resource_slices": None,
        "prepared_claims": None,
    }


def _document(dra: dict[str, Any]) -> dict[str, Any]:
    """A whole v1 document around the section (nothing else on the node), schema-checked."""
    document = {
        "schema": "mixed-cpu-nri-plugin/status/v1",
        "version": "0.1.0",
        "time": "2025-11-27T10:00:00Z",
        "daemon": {
            "pid": 7,
            "config": "/etc/mixed-cpu-nri/config.toml",
            "state_dir": "/var/lib/mixed-cpu-nri",
        },
        "runtime": {
            "state": "ready",
            "name": "containerd",
            "version": "v2.3.4",
            "nri_version": None,
            "connected_since": "2025-11-27T09:00:00Z",
            "connections": 1,
            "synchronizations": 1,
        },
        "device_plugin": {
            "enabled": False,
            "state": None,
            "resource_name": None,
            "registered": False,
            "registrations": 0,
        },
        "pod_resources": {"configured": False, "socket": None, "reachable": None, "proof": None},
        "dra": dra,
        "pool": {"cpus": "0-1", "numa_local": False, "numa_nodes": [], "containers": 0},
        "containers": [],
        "pods": [],
        "heals": [],
    }
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    return document
