"""`nri_plugin.dra.kubeletplugin` against an independent fake kubelet (tests/dra/fake_kubelet_dra.py)
over real unix sockets: registration through the plugin watcher, prepare / unprepare with real CDI
spec files (each checked against the CDI schema), and the health stream."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import pytest_asyncio
import structlog
from cdi_support import load_valid_spec
from fake_kubelet_dra import (
    HEALTH_VERSION,
    HEALTH_VERSION_ALPHA,
    HEALTHY,
    Claim,
    FakeKubeletDra,
    Prepared,
    health_service,
)
from wait_support import wait_until

from nri_plugin.deviceplugin.marker import HostKey
from nri_plugin.dra import cdi
from nri_plugin.dra.claims import AllocatedDevice, ClaimError, ClaimSourceUnreachable
from nri_plugin.dra.kubeletplugin import (
    FAILURE_LINES,
    PREPARE_CONCURRENCY,
    DraKubeletPlugin,
    DraPluginError,
    DraPluginSettings,
)

DRIVER = "shared-cpus.mixed-cpu.openshift.io"
NODE = "node-1"
DEVICES = tuple(f"shared-cpus-{i}" for i in range(4))
KIND = "mixed-cpu.openshift.io/shared-cpus"

UID_A = "0b5f6a1e-3c1d-4e8a-9f00-5a1b2c3d4e5f"
UID_B = "1c6a7b2f-4d2e-4f9b-8011-6b2c3d4e5f60"
UID_C = "2d7b8c30-5e3f-4a0c-9122-7c3d4e5f6071"
CLAIM_A = Claim("team-a", "web-0-shared", UID_A)
CLAIM_B = Claim("team-a", "web-1-shared", UID_B)
CLAIM_C = Claim("team-b", "refused", UID_C)
A_DEVICES = [("shared", "shared-cpus-1")]
B_DEVICES = [("shared", "shared-cpus-2"), ("more", "shared-cpus-3")]


def _spec_name(uid: str) -> str:
    return f"mixed-cpu.openshift.io-shared-cpus_{uid}.json"


@dataclass
class FakeClaimSource:
    """The API server's view of the claims: allocated devices by uid; `down` makes every call fail as
    an unreachable server does, `answer` makes it fail with the server's answer (e.g. a 404)."""

    allocations: dict[str, tuple[AllocatedDevice, ...]] = field(default_factory=dict)
    down: bool = False
    answer: str = ""
    calls: int = 0
    reading: int = 0  # reads under way now
    most_reading: int = 0  # the most under way at once
    delay: float = 0.0  # each read takes this long (seconds)

    async def allocated_devices(self, namespace: str, name: str, uid: str) -> tuple[AllocatedDevice, ...]:
        self.calls += 1
        self.reading += 1
        self.most_reading = max(self.most_reading, self.reading)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
        finally:
            self.reading -= 1
        if self.down:
            raise ClaimSourceUnreachable("the API server could not be reached: connection refused")
        if self.answer:
            raise ClaimError(self.answer)
        if uid not in self.allocations:
            raise ClaimError(f"claim {namespace}/{name} has no allocation of this driver")
        return self.allocations[uid]


@dataclass
class Node:
    root: Path
    registry_dir: Path
    plugins_dir: Path
    cdi_dir: Path
    settings: DraPluginSettings
    key: HostKey
    source: FakeClaimSource
    kubelet: FakeKubeletDra


@pytest.fixture
def node() -> Iterator[Node]:
    # Unix socket paths are limited to 107 bytes and pytest's tmp_path can be longer.
    root = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    registry_dir, plugins_dir, cdi_dir = root / "registry", root / "plugins", root / "cdi"
    registry_dir.mkdir()
    settings = DraPluginSettings(
        driver_name=DRIVER,
        registry_dir=registry_dir,
        plugins_dir=plugins_dir,
        cdi_dir=cdi_dir,
        pool_name=NODE,
        device_names=DEVICES,
        check_interval=0.02,
        claim_timeout=5.0,
        fsync=False,
    )
    cdi_dir.mkdir()
    source = FakeClaimSource(
        {
            UID_A: tuple(AllocatedDevice(request, NODE, device) for request, device in A_DEVICES),
            UID_B: (
                AllocatedDevice("shared", NODE, "shared-cpus-2"),
                AllocatedDevice("more", NODE, "shared-cpus-3"),
            ),
        }
    )
    yield Node(
        root,
        registry_dir,
        plugins_dir,
        cdi_dir,
        settings,
        HostKey(os.urandom(32)),
        source,
        FakeKubeletDra(registry_dir),
    )
    shutil.rmtree(root, ignore_errors=True)


@pytest_asyncio.fixture
async def plugin(node: Node) -> AsyncIterator[DraKubeletPlugin]:
    async with DraKubeletPlugin(node.settings, node.key, node.source) as served:
        yield served
    await node.kubelet.close()


async def _registered(node: Node, plugin: DraKubeletPlugin) -> None:
    (socket,) = node.kubelet.registration_sockets()
    await node.kubelet.register(socket)
    await asyncio.wait_for(plugin.wait_registered(), 15)


def _spec_files(node: Node) -> list[str]:
    return sorted(p.name for p in node.cdi_dir.iterdir())


def _files_outside_cdi_dir(node: Node) -> list[Path]:
    return [p for p in node.root.rglob("*") if p.is_file() and node.cdi_dir not in p.parents]


def _check_prepared_claim(node: Node, claim: Claim, answer: Prepared, devices: list[tuple[str, str]]) -> None:
    """`answer` names `devices` ((request, device) pairs), and the claim's spec file carries, for each,
    the env marker that verifies to ``dra.<device>``."""
    assert answer.error == ""
    assert [(d.request_names, d.pool_name, d.device_name) for d in answer.devices] == [
        ((request,), NODE, device) for request, device in devices
    ]
    assert [d.cdi_device_ids for d in answer.devices] == [
        (f"{KIND}={claim.uid}-{device}",) for _, device in devices
    ]
    spec = load_valid_spec(node.cdi_dir / _spec_name(claim.uid))
    assert spec["kind"] == KIND
    by_name = {d["name"]: d for d in spec["devices"]}
    for _, device in devices:
        env = dict(e.split("=", 1) for e in by_name[f"{claim.uid}-{device}"]["containerEdits"]["env"])
        assert node.key.verify(env[cdi.marker_env(device)]) == f"dra.{device}"


# -- registration -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_kubelet_registers_the_plugin(node: Node, plugin: DraKubeletPlugin) -> None:
    assert not plugin.registered
    sockets = node.kubelet.registration_sockets()
    assert sockets == [node.registry_dir / f"{DRIVER}-reg.sock"]
    registered = await node.kubelet.register(sockets[0])
    assert registered.info.type == "DRAPlugin"
    assert registered.info.name == DRIVER
    assert registered.info.endpoint == str(node.plugins_dir / DRIVER / "dra.sock")
    assert set(registered.info.supported_versions) == {"v1.DRAPlugin", HEALTH_VERSION, HEALTH_VERSION_ALPHA}
    await asyncio.wait_for(plugin.wait_registered(), 15)
    assert plugin.registered
    assert plugin.registration_error == ""
    for path in (sockets[0], Path(registered.info.endpoint)):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600


@pytest.mark.asyncio
async def test_each_registration_is_announced_to_on_registered(node: Node, plugin: DraKubeletPlugin) -> None:
    """The front door checks the ResourceSlices then: a new registration often follows a kubelet
    start, which wiped them."""
    calls: list[int] = []
    plugin.on_registered = lambda: calls.append(plugin.registrations)
    (socket,) = node.kubelet.registration_sockets()
    await node.kubelet.notify(socket, False, "refused")  # a refusal is not a registration
    await _registered(node, plugin)
    await _registered(node, plugin)  # kubelet restarted and registered the socket again
    assert calls == [1, 2]


@pytest.mark.asyncio
async def test_a_refusal_from_kubelet_is_recorded(node: Node, plugin: DraKubeletPlugin) -> None:
    (socket,) = node.kubelet.registration_sockets()
    await node.kubelet.notify(socket, False, "no handler for this plugin type")
    assert not plugin.registered
    assert plugin.registration_error == "no handler for this plugin type"
    await _registered(node, plugin)
    assert plugin.registration_error == ""


@pytest.mark.asyncio
async def test_a_deleted_registration_socket_is_served_again(node: Node, plugin: DraKubeletPlugin) -> None:
    await _registered(node, plugin)
    (socket,) = node.kubelet.registration_sockets()
    calls = node.kubelet.get_info_calls
    socket.unlink()  # an operator's clean-up, or a starting kubelet's
    await wait_until(lambda: node.kubelet.registration_sockets() == [socket], what="registration socket back")
    await wait_until(lambda: not plugin.registered, what="registration forgotten")
    await _registered(node, plugin)  # kubelet's plugin watcher sees a new socket: GetInfo again
    assert node.kubelet.get_info_calls == calls + 1
    assert plugin.registration_sockets == 2


@pytest.mark.asyncio
async def test_a_stale_socket_is_replaced_and_close_removes_ours(node: Node) -> None:
    import socket as sockets

    stale = node.registry_dir / f"{DRIVER}-reg.sock"
    leftover = sockets.socket(sockets.AF_UNIX)
    leftover.bind(str(stale))
    leftover.close()
    plugin = DraKubeletPlugin(node.settings, node.key, node.source)
    async with plugin:
        await _registered(node, plugin)
    assert not stale.exists()
    assert not (node.plugins_dir / DRIVER / "dra.sock").exists()
    await node.kubelet.close()


@pytest.mark.asyncio
async def test_a_file_in_the_way_is_a_clear_error(node: Node) -> None:
    (node.registry_dir / f"{DRIVER}-reg.sock").write_text("not a socket")
    with pytest.raises(DraPluginError, match=r"reg\.sock exists and is not a socket; remove it"):
        await DraKubeletPlugin(node.settings, node.key, node.source).start()
    assert not (node.plugins_dir / DRIVER / "dra.sock").exists()  # nothing left serving


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"driver_name": "../evil"}, "not a DNS subdomain"),
        ({"driver_name": "Shared.Example"}, "not a DNS subdomain"),
        ({"pool_name": ""}, "pool name"),
        ({"registry_dir": "/tmp/" + "d" * 120}, "over 107, the unix socket limit"),
    ],
)
def test_bad_settings_are_refused_with_what_to_set(node: Node, change: dict[str, str], match: str) -> None:
    with pytest.raises(DraPluginError, match=match):
        replace(node.settings, **change)  # type: ignore[arg-type]


# -- prepare / unprepare ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_prepare_writes_the_spec_and_answers_its_cdi_devices(
    node: Node, plugin: DraKubeletPlugin
) -> None:
    await _registered(node, plugin)
    answers = await node.kubelet.prepare(DRIVER, [CLAIM_A, CLAIM_B])
    assert set(answers) == {UID_A, UID_B}
    _check_prepared_claim(node, CLAIM_A, answers[UID_A], A_DEVICES)
    _check_prepared_claim(node, CLAIM_B, answers[UID_B], B_DEVICES)
    mode = (node.cdi_dir / _spec_name(UID_A)).stat().st_mode
    assert stat.S_IMODE(mode) == 0o600


@pytest.mark.asyncio
async def test_prepare_twice_gives_the_same_answer_and_file(node: Node, plugin: DraKubeletPlugin) -> None:
    """The same answer and the same file, but for its marker: each prepare is a new allocation of
    the device (numbered above the last), so a container created after it is kubelet's newest."""
    await _registered(node, plugin)
    first = await node.kubelet.prepare(DRIVER, [CLAIM_A])
    path = node.cdi_dir / _spec_name(UID_A)
    content = json.loads(path.read_bytes())
    again = await node.kubelet.prepare(DRIVER, [CLAIM_A])
    assert again == first
    content_again = json.loads(path.read_bytes())
    [before], [after] = (spec["devices"][0]["containerEdits"]["env"] for spec in (content, content_again))
    marker_before = node.key.read(before.partition("=")[2])
    marker_after = node.key.read(after.partition("=")[2])
    assert marker_before is not None
    assert marker_after is not None
    assert marker_after.device == marker_before.device
    assert marker_after.allocation > marker_before.allocation
    for spec in (content, content_again):
        del spec["devices"][0]["containerEdits"]
    assert content_again == content
    assert _spec_files(node) == [path.name]


@pytest.mark.asyncio
async def test_unprepare_removes_the_spec_and_twice_is_fine(node: Node, plugin: DraKubeletPlugin) -> None:
    await _registered(node, plugin)
    await node.kubelet.prepare(DRIVER, [CLAIM_A, CLAIM_B])
    assert await node.kubelet.unprepare(DRIVER, [CLAIM_A]) == {UID_A: ""}
    assert _spec_files(node) == [_spec_name(UID_B)]
    with structlog.testing.capture_logs() as logs:
        assert await node.kubelet.unprepare(DRIVER, [CLAIM_A, CLAIM_B]) == {UID_A: "", UID_B: ""}
    assert await node.kubelet.unprepare(DRIVER, [CLAIM_A, CLAIM_B]) == {UID_A: "", UID_B: ""}
    assert _spec_files(node) == []
    # One info line per call; each claim at debug level.
    [done] = [e for e in logs if e["log_level"] == "info"]
    assert (done["event"], done["claims"], done["succeeded"], done["failed"]) == (
        "NodeUnprepareResources done",
        2,
        2,
        0,
    )
    assert [e["uid"] for e in logs if e["log_level"] == "debug"] == [UID_A, UID_B]


@pytest.mark.asyncio
async def test_a_refused_claim_fails_alone(node: Node, plugin: DraKubeletPlugin) -> None:
    await _registered(node, plugin)
    answers = await node.kubelet.prepare(DRIVER, [CLAIM_A, CLAIM_C, CLAIM_B])
    assert set(answers) == {UID_A, UID_B, UID_C}
    assert answers[UID_C].devices == ()
    assert "team-b/refused" in answers[UID_C].error
    assert "has no allocation of this driver" in answers[UID_C].error
    _check_prepared_claim(node, CLAIM_A, answers[UID_A], A_DEVICES)
    _check_prepared_claim(node, CLAIM_B, answers[UID_B], B_DEVICES)
    assert _spec_name(UID_C) not in _spec_files(node)


@pytest.mark.asyncio
async def test_a_claim_of_another_nodes_pool_is_refused(node: Node, plugin: DraKubeletPlugin) -> None:
    node.source.allocations[UID_C] = (AllocatedDevice("shared", "node-2", "shared-cpus-0"),)
    await _registered(node, plugin)
    answers = await node.kubelet.prepare(DRIVER, [CLAIM_C])
    assert "allocated for another node" in answers[UID_C].error
    assert _spec_files(node) == []


@pytest.mark.asyncio
async def test_after_a_restart_prepare_is_answered_from_the_file_while_the_source_is_down(node: Node) -> None:
    async with DraKubeletPlugin(node.settings, node.key, node.source) as plugin:
        await _registered(node, plugin)
        first = await node.kubelet.prepare(DRIVER, [CLAIM_A, CLAIM_B])
    await node.kubelet.close()
    node.source.down = True  # the daemon restarts during an API server outage
    async with DraKubeletPlugin(node.settings, node.key, node.source) as plugin:
        await _registered(node, plugin)
        calls = node.source.calls
        again = await node.kubelet.prepare(DRIVER, [CLAIM_A, CLAIM_B, CLAIM_C])
        assert node.source.calls == calls + 3  # the source was asked first
        assert again[UID_A] == first[UID_A]
        assert again[UID_B] == first[UID_B]
        assert "could not be reached" in again[UID_C].error  # never prepared: no file to answer from
        _check_prepared_claim(node, CLAIM_A, again[UID_A], A_DEVICES)
        assert await node.kubelet.unprepare(DRIVER, [CLAIM_A]) == {UID_A: ""}  # needs no API server
    await node.kubelet.close()


@pytest.mark.asyncio
async def test_a_source_that_hangs_falls_back_to_the_file(node: Node) -> None:
    class Hanging(FakeClaimSource):
        async def allocated_devices(self, namespace: str, name: str, uid: str) -> tuple[AllocatedDevice, ...]:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    async with DraKubeletPlugin(node.settings, node.key, node.source) as plugin:
        await _registered(node, plugin)
        first = await node.kubelet.prepare(DRIVER, [CLAIM_A])
    await node.kubelet.close()
    settings = replace(node.settings, claim_timeout=0.05)
    async with DraKubeletPlugin(settings, node.key, Hanging()) as plugin:
        await _registered(node, plugin)
        again = await node.kubelet.prepare(DRIVER, [CLAIM_A, CLAIM_B])
    await node.kubelet.close()
    assert again[UID_A] == first[UID_A]
    assert "no answer within 0.05 s" in again[UID_B].error


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "uid",
    ["../x", "../../../../etc/cron.d/x", "a/../../b", "x" * 4000, UID_A.upper(), "", f"{UID_A}/../x"],
)
async def test_a_hostile_uid_is_refused_and_nothing_is_written(
    node: Node, plugin: DraKubeletPlugin, uid: str
) -> None:
    node.source.allocations[uid] = (AllocatedDevice("shared", NODE, "shared-cpus-0"),)
    await _registered(node, plugin)
    answers = await node.kubelet.prepare(DRIVER, [Claim("team-a", "evil", uid), CLAIM_A])
    assert "is not a Kubernetes UID" in answers[uid].error
    assert len(answers[uid].error) < 500
    assert answers[uid].devices == ()
    assert answers[UID_A].error == ""
    unprepared = await node.kubelet.unprepare(DRIVER, [Claim("team-a", "evil", uid)])
    assert "is not a Kubernetes UID" in unprepared[uid]
    assert _spec_files(node) == [_spec_name(UID_A)]
    assert not [p for p in _files_outside_cdi_dir(node) if p.suffix == ".json"]
    assert node.source.calls == 1  # a hostile uid never reaches the API server


@pytest.mark.asyncio
async def test_a_damaged_spec_file_is_an_error_for_its_claim_only(
    node: Node, plugin: DraKubeletPlugin
) -> None:
    await _registered(node, plugin)
    (node.cdi_dir / _spec_name(UID_A)).write_text("{")
    node.source.down = True
    answers = await node.kubelet.prepare(DRIVER, [CLAIM_A])
    assert "is not one this driver wrote" in answers[UID_A].error
    node.source.down = False
    answers = await node.kubelet.prepare(DRIVER, [CLAIM_A])  # the API server answers: rewritten
    _check_prepared_claim(node, CLAIM_A, answers[UID_A], A_DEVICES)


@pytest.mark.asyncio
@pytest.mark.parametrize("device", ["shared-cpus-4", "shared-cpus-19999"])
async def test_a_device_the_node_did_not_publish_is_refused(
    node: Node, plugin: DraKubeletPlugin, device: str
) -> None:
    node.source.allocations[UID_C] = (AllocatedDevice("shared", NODE, device),)  # 4 were published
    await _registered(node, plugin)
    answers = await node.kubelet.prepare(DRIVER, [CLAIM_C, CLAIM_A])
    assert f"device {device} is not one this node published" in answers[UID_C].error
    assert answers[UID_C].devices == ()
    assert answers[UID_A].error == ""
    assert _spec_files(node) == [_spec_name(UID_A)]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "failure",
    [
        ClaimError("ResourceClaim team-a/web-0-shared does not exist (deleted?); nothing to prepare"),
        ClaimError("the API server failed reading ResourceClaim team-a/web-0-shared (503: unavailable)"),
        RuntimeError("a bug in the claim source"),
    ],
)
async def test_an_answer_of_the_api_server_is_final_whatever_file_is_there(
    node: Node, plugin: DraKubeletPlugin, failure: Exception
) -> None:
    """The spec written before answers only while the API server cannot be reached: a claim it says
    is gone (or any other answer, or a broken source) is the claim's error."""

    class Answering(FakeClaimSource):
        async def allocated_devices(self, namespace: str, name: str, uid: str) -> tuple[AllocatedDevice, ...]:
            raise failure

    await _registered(node, plugin)
    assert (await node.kubelet.prepare(DRIVER, [CLAIM_A]))[UID_A].error == ""
    spec = (node.cdi_dir / _spec_name(UID_A)).read_bytes()
    plugin.claims = Answering()
    again = (await node.kubelet.prepare(DRIVER, [CLAIM_A]))[UID_A]
    assert again.devices == ()
    expected = str(failure) if isinstance(failure, ClaimError) else "the claim source failed"
    assert expected in again.error
    assert (node.cdi_dir / _spec_name(UID_A)).read_bytes() == spec  # not rewritten either


@pytest.mark.asyncio
async def test_a_planted_spec_is_not_answered_while_the_api_server_is_down(
    node: Node, plugin: DraKubeletPlugin
) -> None:
    """Someone who can write the CDI directory but does not hold the node's key writes a spec in
    our format for a claim: with the API server unreachable, it is refused, and left as it was."""
    await _registered(node, plugin)
    other = DraKubeletPlugin(
        replace(node.settings, cdi_dir=node.root / "elsewhere"), HostKey(os.urandom(32)), node.source
    )
    node.source.allocations[UID_C] = (AllocatedDevice("shared", NODE, "shared-cpus-1"),)
    assert (await other._prepare(CLAIM_C.namespace, CLAIM_C.name, UID_C)).error == ""
    planted = (node.root / "elsewhere" / _spec_name(UID_C)).read_bytes()
    (node.cdi_dir / _spec_name(UID_C)).write_bytes(planted)
    node.source.down = True
    answer = (await node.kubelet.prepare(DRIVER, [CLAIM_C]))[UID_C]
    assert answer.devices == ()
    assert "is not one this driver wrote" in answer.error
    assert "marker this node's key signs" in answer.error
    assert (node.cdi_dir / _spec_name(UID_C)).read_bytes() == planted


@pytest.mark.asyncio
async def test_a_large_call_is_prepared_a_few_claims_at_a_time(node: Node, plugin: DraKubeletPlugin) -> None:
    """Many claims in one call: at most PREPARE_CONCURRENCY are read at once, all are answered."""
    node.source.delay = 0.002  # each read waits on the API server a little
    claims = []
    for n in range(120):
        uid = str(uuid.UUID(int=n + 1, version=4))
        node.source.allocations[uid] = (AllocatedDevice("shared", NODE, DEVICES[n % len(DEVICES)]),)
        claims.append(Claim("team-a", f"claim-{n}", uid))
    await _registered(node, plugin)
    answers = await node.kubelet.prepare(DRIVER, claims)
    assert sorted(answers) == sorted(c.uid for c in claims)
    assert all(answer.error == "" for answer in answers.values())
    assert node.source.most_reading == PREPARE_CONCURRENCY  # overlapped, and bounded
    assert len(_spec_files(node)) == len(claims)


@pytest.mark.asyncio
async def test_claims_that_fail_at_once_still_give_the_loop_back_between_them(
    node: Node, plugin: DraKubeletPlugin
) -> None:
    """Claims refused without any I/O (a bad uid) never hold the loop for the whole call: other
    tasks run between them; and only the first FAILURE_LINES are logged one by one."""
    await _registered(node, plugin)
    claims = [Claim("team-a", f"bad-{n}", f"not-a-uid-{n}") for n in range(400)]
    turns = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal turns
        while not done.is_set():
            await asyncio.sleep(0)
            turns += 1

    ticking = asyncio.ensure_future(ticker())
    with structlog.testing.capture_logs() as logs:
        answers = await node.kubelet.prepare(DRIVER, claims)
    done.set()
    await ticking
    assert all("is not a Kubernetes UID" in answer.error for answer in answers.values())
    assert turns >= len(claims) // PREPARE_CONCURRENCY  # the loop turned between the claims
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert len(warnings) == FAILURE_LINES
    [summary] = [entry for entry in logs if entry["event"] == "NodePrepareResources done"]
    assert (summary["failed"], summary["failures_not_logged"]) == (400, 400 - FAILURE_LINES)


@pytest.mark.asyncio
async def test_a_huge_registration_error_is_kept_capped_and_escaped(
    node: Node, plugin: DraKubeletPlugin
) -> None:
    (socket,) = node.kubelet.registration_sockets()
    error = "refused\n\x1b[31mFAKE" + "y" * 3_000_000
    await node.kubelet.notify(socket, False, error)
    kept = plugin.registration_error
    assert len(kept) < 600
    assert kept.startswith("refused\\n\\x1b[31mFAKE")
    assert kept.endswith(f"... ({len(error)} characters)")
    assert kept.isprintable()


@pytest.mark.asyncio
async def test_a_file_planted_over_a_socket_is_warned_of_once_while_it_lasts(
    node: Node, plugin: DraKubeletPlugin
) -> None:
    endpoint = node.plugins_dir / DRIVER / "dra.sock"
    with structlog.testing.capture_logs() as logs:
        endpoint.unlink()
        endpoint.write_text("planted")
        await wait_until(
            lambda: sum(e["event"] == "DRA plugin socket still cannot be re-created" for e in logs) >= 10,
            what="ten attempts failed",
        )
        endpoint.unlink()
        await wait_until(lambda: stat.S_ISSOCK(os.lstat(endpoint).st_mode) if endpoint.exists() else False)
        await wait_until(lambda: any(e["event"] == "DRA plugin sockets served again" for e in logs))
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"].split(";")[0] for e in warnings] == [
        "DRA service socket gone",
        "DRA plugin socket could not be re-created",
    ]


# -- health -------------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("minor", "service"), [(34, HEALTH_VERSION_ALPHA), (36, HEALTH_VERSION_ALPHA), (37, HEALTH_VERSION)]
)
async def test_the_health_stream_lists_every_device_healthy(
    node: Node, plugin: DraKubeletPlugin, minor: int, service: str
) -> None:
    """kubelets 1.34-1.36 open v1alpha1 (their only client), 1.37 picks v1 from what we announce."""
    node.kubelet.minor = minor
    await _registered(node, plugin)
    assert health_service(minor, node.kubelet.plugins[DRIVER].info.supported_versions) == service
    stream = node.kubelet.watch_health(DRIVER)
    first = await asyncio.wait_for(anext(stream), 15)
    assert [(d.pool_name, d.device_name, d.health) for d in first] == [
        (NODE, name, HEALTHY) for name in DEVICES
    ]
    assert all(d.last_updated_time > 0 for d in first)
    assert plugin.open_health_streams == 1
    await stream.aclose()
    await wait_until(lambda: plugin.open_health_streams == 0, what="health stream closed")


@pytest.mark.asyncio
async def test_close_ends_an_open_health_stream(node: Node) -> None:
    plugin = DraKubeletPlugin(node.settings, node.key, node.source)
    await plugin.start()
    await _registered(node, plugin)
    stream = node.kubelet.watch_health(DRIVER)
    await asyncio.wait_for(anext(stream), 15)
    await asyncio.wait_for(plugin.close(), 15)
    assert plugin.open_health_streams == 0
    await stream.aclose()
    await node.kubelet.close()
