"""The allocation marker: signing and checking, with a key in memory (its file: test_deviceplugin_keyfile)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, HostKey

KEY_A = HostKey(bytes(range(32)))
KEY_B = HostKey(bytes(range(1, 33)))
device_id_strategy = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", fullmatch=True)

# ---------------------------------------------------------------------------------------------------
# sign / verify
# ---------------------------------------------------------------------------------------------------


def test_annotation_key_is_a_valid_kubernetes_annotation_key() -> None:
    prefix, name = ANNOTATION_KEY.split("/")
    assert len(prefix) <= 253
    assert len(name) <= 63
    assert prefix == prefix.lower()


def test_sign_then_verify() -> None:
    value = KEY_A.sign("shared-cpus-7")
    assert value.startswith("v1:shared-cpus-7:")
    assert KEY_A.verify(value) == "shared-cpus-7"
    assert KEY_A.verify_annotations({ANNOTATION_KEY: value, "other": "x"}) == "shared-cpus-7"


def test_signing_is_deterministic_per_key_and_id() -> None:
    assert KEY_A.sign("shared-cpus-1") == KEY_A.sign("shared-cpus-1")
    assert KEY_A.sign("shared-cpus-1") != KEY_A.sign("shared-cpus-2")
    assert KEY_A.sign("shared-cpus-1") != KEY_B.sign("shared-cpus-1")


def test_marker_made_with_another_key_is_refused() -> None:
    assert KEY_B.verify(KEY_A.sign("shared-cpus-1")) is None


def test_signature_moved_to_another_device_id_is_refused() -> None:
    mac = KEY_A.sign("shared-cpus-1").rpartition(":")[2]
    assert KEY_A.verify(f"v1:shared-cpus-2:{mac}") is None


def test_forged_mac_is_refused() -> None:
    forged = base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()
    assert KEY_A.verify(f"v1:shared-cpus-1:{forged}") is None


@pytest.mark.parametrize(
    "value",
    [
        None,
        7,
        b"v1:shared-cpus-1:x",
        "",
        "1",
        "true",
        "shared-cpus-1",
        "v2:shared-cpus-1:" + "A" * 43,
        "v1::" + "A" * 43,
        "v1:shared-cpus-1:" + "A" * 42,
        "v1:shared-cpus-1:" + "A" * 44,
        "v1:shared-cpus-1:" + "A" * 42 + "=",
        "v1:a:b:" + "A" * 43,
    ],
)
def test_malformed_values_are_refused(value: object) -> None:
    assert KEY_A.verify(value) is None


def test_altered_marker_is_refused() -> None:
    value = KEY_A.sign("shared-cpus-1")
    assert KEY_A.verify(value + " ") is None
    assert KEY_A.verify(" " + value) is None
    assert KEY_A.verify(value.upper()) is None
    last = value[-1]
    assert KEY_A.verify(value[:-1] + ("B" if last != "B" else "C")) is None


def test_missing_annotation() -> None:
    assert KEY_A.verify_annotations({}) is None
    assert KEY_A.verify_annotations({"workload.openshift.io/enable-shared-cpus": "1"}) is None


@pytest.mark.parametrize("device_id", ["", "a:b", "-x", "x" * 64, "é", "a b"])
def test_sign_refuses_ids_kubelet_would_not_give(device_id: str) -> None:
    with pytest.raises(ValueError, match="cannot sign device id"):
        KEY_A.sign(device_id)


@given(device_id_strategy)
def test_round_trip_for_every_valid_id(device_id: str) -> None:
    assert KEY_A.verify(KEY_A.sign(device_id)) == device_id
    assert KEY_B.verify(KEY_A.sign(device_id)) is None


@given(st.text(max_size=200))
def test_verify_never_raises_and_never_accepts_noise(value: str) -> None:
    assert KEY_A.verify(value) is None


def test_secret_size_and_repr() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        HostKey(b"short")
    assert "00010203" not in repr(KEY_A)
    assert repr(KEY_A) == "HostKey(path=None)"


def test_importing_the_marker_loads_no_io_or_logging() -> None:
    """The pure policy imports the marker: it must not bring asyncio, sockets, grpc, logging or file I/O."""
    heavy = [
        "asyncio",
        "socket",
        "grpc",
        "structlog",
        "logging",
        "nri_plugin.common.atomicfile",
        "nri_plugin.deviceplugin.keyfile",
    ]
    probe = (
        "import sys; import nri_plugin.deviceplugin.marker;"
        f" print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""
