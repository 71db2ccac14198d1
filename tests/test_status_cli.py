"""``mixed-cpu-nri-plugin status`` against the real daemon process (``run``, driven by the runtime
simulator): the JSON read back against the daemon's books (its state file) and the schema, the table,
``--watch``; and each way it cannot ask, as one line with the fix: not running, a socket nobody
listens on, not root, a config it cannot read."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from mixedcpu_support import ROOT, Daemon, daemon_process, run_cli, saved_books, write_daemon_config

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.daemon import status_client
from nri_plugin.daemon.status import StatusServer
from nri_plugin.daemon.status_client import render_table, run_status
from nri_plugin.deviceplugin.keyfile import load_or_create_host_key
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY
from nri_plugin.nri.simulator import RuntimeSimulator

GUARD = 20.0  # against hangs only
SCHEMA = json.loads((ROOT / "docs" / "status.schema.json").read_text())


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes (the device plugin's, the status socket).
    path = Path(tempfile.mkdtemp(prefix="sc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("status", *args, timeout=GUARD)


def _books(state_dir: Path) -> dict[str, Any]:
    """The daemon's books as its database holds them: pod key -> its baseline and slots."""
    books = saved_books(state_dir)
    return {
        key: {"baseline": pod.baseline, "containers": {n: {"id": r.id} for n, r in pod.containers.items()}}
        for key, pod in books.pods.items()
    }


@pytest.mark.asyncio
async def test_status_reads_back_the_real_daemons_books(short_dir: Path) -> None:
    plugin_dir = short_dir / "dp"
    plugin_dir.mkdir()
    config = write_daemon_config(short_dir, plugin_dir)  # kubelet's PodResources socket: pr.sock, absent
    pod_dir = short_dir / "cgroup" / "cpu" / "kubepods" / "pod1234"
    pod_dir.mkdir(parents=True)
    (pod_dir / "cpu.cfs_quota_us").write_text("200000\n")
    (pod_dir / "cpu.cfs_period_us").write_text("100000\n")
    socket_path = short_dir / "nri.sock"
    argv = ("--log-level", "info", "run", "--config", str(config))
    async with (
        RuntimeSimulator(socket_path, runtime_name="containerd", runtime_version="v2.3.4") as sim,
        daemon_process(*argv) as proc,
    ):
        daemon = Daemon(proc)
        await sim.wait_for_synchronizations(1, GUARD)
        await daemon.wait_log("serving the status")
        key = load_or_create_host_key(short_dir / "state")
        pod = api.PodSandbox(id="s1", uid="1234", name="web", namespace="shop")
        pod.linux.cgroup_parent = "/kubepods/pod1234"
        await sim.run_pod_sandbox(pod)
        container = api.Container(id="c1", pod_sandbox_id="s1", name="main")
        container.annotations[ANNOTATION_KEY] = key.sign("shared-cpus-0")
        container.linux.cgroups_path = "/kubepods/pod1234/c1"
        container.linux.resources.cpu.cpus = "2-3"
        container.linux.resources.cpu.quota.value = 200000
        container.linux.resources.cpu.period.value = 100000
        await sim.create_container(container)

        answer = await asyncio.to_thread(_status, "--config", str(config), "--output", "json")
        assert answer.returncode == 0, answer.stderr
        document = json.loads(answer.stdout)
        jsonschema.Draft202012Validator(SCHEMA).validate(document)
        books = _books(short_dir / "state")  # a new baseline: saved before the reply
        assert [row["container_id"] for row in document["containers"]] == [
            entry["id"] for pod_entry in books.values() for entry in pod_entry["containers"].values()
        ]
        row = document["containers"][0]
        assert (row["namespace"], row["pod"], row["container"], row["pod_key"]) == (
            "shop",
            "web",
            "main",
            "1234",
        )
        assert (row["exclusive_cpus"], row["shared_cpus"], row["device"]) == ("2-3", "0-1", "shared-cpus-0")
        # kubelet's PodResources socket is absent here: the marker binding proves the request.
        assert row["proof"] == "marker-binding"
        assert document["pod_resources"]["configured"] is True
        assert document["pod_resources"]["reachable"] is False
        assert document["dra"]["enabled"] is False  # [dra] not enabled
        (pod_row,) = document["pods"]
        assert pod_row["quota_baseline_us"] == books["1234"]["baseline"] == 200000
        assert pod_row["quota_now_us"] == pod_row["quota_target_us"] == 400000
        assert int((pod_dir / "cpu.cfs_quota_us").read_text()) == 400000
        assert (document["runtime"]["name"], document["runtime"]["state"]) == ("containerd", "ready")
        assert document["daemon"]["pid"] == proc.pid
        assert document["daemon"]["state_dir"] == str(short_dir / "state")

        table = await asyncio.to_thread(_status, "--config", str(config))
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[1].startswith("runtime        containerd v2.3.4 (NRI v0.12.0): ready, connected ")
        assert lines[3] == (
            f"pod resources  NOT reachable: the marker binding alone proves requests ({short_dir}/pr.sock)"
        )
        assert lines[4] == "DRA            off"
        assert "shared pool    0-1: 1 container" in lines
        header = lines.index("SHARED CONTAINERS (1)") + 1
        assert lines[header].split() == [
            "NAMESPACE", "POD", "CONTAINER", "EXCLUSIVE", "SHARED", "PROOF", "DEVICE", "HELD", "FOR"
        ]  # fmt: skip
        assert lines[header + 1].split()[:7] == [
            "shop", "web", "main", "2-3", "0-1", "marker-binding", "shared-cpus-0"
        ]  # fmt: skip
        quotas = lines.index("POD QUOTAS (1, in CPUs: quota / period)") + 2
        assert lines[quotas].split() == ["shop", "web", "4", "4", "2", "(first-seen)", "at", "target"]

        # Found without the config: by its state dir, by its socket, and (a node whose config lives
        # in the daemon's pod) in the default state dir when there is no default config file.
        by_dir = await asyncio.to_thread(_status, "--state-dir", str(short_dir / "state"), "-o", "json")
        assert json.loads(by_dir.stdout)["daemon"]["pid"] == proc.pid, by_dir.stderr
        by_socket = await asyncio.to_thread(_status, "--socket", str(short_dir / "state" / "status.sock"))
        assert by_socket.stdout.splitlines()[2:5] == lines[2:5], by_socket.stderr
        out, err = io.StringIO(), io.StringIO()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(status_client, "DEFAULT_CONFIG_PATH", str(short_dir / "etc" / "config.toml"))
            patch.setattr(status_client, "DEFAULT_STATE_DIR", str(short_dir / "state"))
            found = await asyncio.to_thread(run_status, output="json", out=out, err=err)
        assert found == 0, err.getvalue()
        assert json.loads(out.getvalue())["daemon"]["pid"] == proc.pid

        # --watch: one JSON line per refresh, until interrupted.
        watcher = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "nri_plugin.daemon.cli", "status", "--config", str(config),
            "--output", "json", "--watch", "0.1",
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert watcher.stdout is not None
            for _ in range(2):
                line = await asyncio.wait_for(watcher.stdout.readline(), GUARD)
                assert json.loads(line)["containers"][0]["container_id"] == "c1"
        finally:
            watcher.kill()
            await watcher.wait()
        assert await daemon.stop() == 0

    gone = await asyncio.to_thread(_status, "--config", str(config))
    assert gone.returncode == 1
    status_socket = short_dir / "state" / "status.sock"
    assert gone.stderr.splitlines() == [
        f"error: no status socket at {status_socket}: the daemon is not running, or runs with another "
        "state_dir; start it (systemctl start mixed-cpu-nri-plugin, or look at its pod), or name its "
        "state dir (--state-dir DIR: the chart's hostPaths.stateDir) or the --config it runs with"
    ]
    assert gone.stdout == ""


def test_a_socket_nobody_listens_on_says_the_daemon_stopped(short_dir: Path) -> None:
    config = short_dir / "config.toml"
    state = short_dir / "state"
    state.mkdir(mode=0o700)
    config.write_text(f'shared_cpuset = "0-1"\nstate_dir = "{state}"\n')
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(state / "status.sock"))
    left.close()
    result = _status("--config", str(config))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"error: nothing answers on {state}/status.sock: the daemon that made it has stopped; start the "
        "daemon again"
    ]


def test_not_root_is_told_to_run_as_root_or_in_the_pod(short_dir: Path) -> None:
    """As a user other than root, with the config readable: the socket (0600, root's) refuses. The
    user may read any file (CAP_DAC_READ_SEARCH), as in the other not-root tests, so that the
    interpreter and its shared library under root's home load, and the state dir is searched."""
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to run the command as another user")
    short_dir.chmod(0o755)
    state = short_dir / "state"
    state.mkdir(mode=0o700)
    config = short_dir / "config.toml"
    config.write_text(f'shared_cpuset = "0-1"\nstate_dir = "{state}"\n')
    config.chmod(0o644)
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # the daemon's socket, as it makes it
    listening.bind(str(state / "status.sock"))
    os.chmod(state / "status.sock", 0o600)
    listening.listen(1)
    with listening:
        result = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", sys.executable, "-m",
             "nri_plugin.daemon.cli", "status", "--config", str(config)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"},
            capture_output=True, text=True, timeout=GUARD, check=False,
        )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"error: permission denied on {state}/status.sock: only root may ask the daemon; run the command "
        "as root (sudo), or inside the daemon's pod: kubectl exec -n <namespace> ds/<daemonset> -- "
        "mixed-cpu-nri-plugin status"
    ]


def test_a_config_it_cannot_read_is_status_2(short_dir: Path) -> None:
    """A config named and missing: the fix is the daemon's own config, or where its socket is (not
    to create a config, which would not make a daemon answer)."""
    result = _status("--config", str(short_dir / "absent.toml"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: {short_dir}/absent.toml: no such file; pass the --config the daemon runs with; or name "
        "the daemon's state dir (--state-dir DIR) or socket (--socket PATH)"
    ]
    fifo = short_dir / "fifo.toml"
    os.mkfifo(fifo)
    refused = _status("--config", str(fifo))  # at once: nothing ever writes to the FIFO
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[0].startswith(f"error: {fifo}: a FIFO, not a regular file")


def test_without_a_config_file_the_default_state_dir_is_asked(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DaemonSet's node: no /etc/mixed-cpu-nri/config.toml; status asks the default state dir."""
    monkeypatch.setattr(status_client, "DEFAULT_CONFIG_PATH", str(short_dir / "etc" / "config.toml"))
    monkeypatch.setattr(status_client, "DEFAULT_STATE_DIR", str(short_dir / "state"))
    err = io.StringIO()
    assert run_status(out=io.StringIO(), err=err) == 1
    assert err.getvalue().startswith(f"error: no status socket at {short_dir}/state/status.sock: ")
    # A default config that is there is read, and its state_dir asked.
    (short_dir / "etc").mkdir()
    (short_dir / "etc" / "config.toml").write_text(f'shared_cpuset = "0"\nstate_dir = "{short_dir}/other"\n')
    err = io.StringIO()
    assert run_status(out=io.StringIO(), err=err) == 1
    assert err.getvalue().startswith(f"error: no status socket at {short_dir}/other/status.sock: ")


def test_where_to_ask_is_one_choice() -> None:
    result = _status("--state-dir", "/tmp", "--socket", "/tmp/s.sock")
    assert result.returncode == 2
    assert "not allowed with argument" in result.stderr


def test_a_watch_interval_must_be_a_sane_number_of_seconds() -> None:
    result = _status("--watch", "0")
    assert result.returncode == 2
    assert "0 is not between 0.1 and 86400 seconds" in result.stderr


def test_the_table_of_an_empty_node_with_numa_and_heals() -> None:
    document: dict[str, Any] = {
        "schema": "mixed-cpu-nri-plugin/status/v1",
        "version": "0.1.0",
        "time": "2025-11-27T10:00:00Z",
        "daemon": {
            "pid": 7,
            "config": "/etc/mixed-cpu-nri/config.toml",
            "state_dir": "/var/lib/mixed-cpu-nri",
        },
        "runtime": {
            "state": "backing_off",
            "name": None,
            "version": None,
            "nri_version": None,
            "connected_since": None,
            "connections": 0,
            "synchronizations": 0,
        },
        "device_plugin": {
            "enabled": False,
            "state": None,
            "resource_name": None,
            "registered": False,
            "registrations": 0,
        },
        "pod_resources": {"configured": False, "socket": None, "reachable": None, "proof": None},
        "dra": {
            "enabled": False,
            "driver": None,
            "node": None,
            "kubelet": None,
            "resource_slices": None,
            "prepared_claims": None,
        },
        "pool": {
            "cpus": "0,4",
            "numa_local": True,
            "numa_nodes": [
                {"node": 0, "cpus": "0", "containers": 0},
                {"node": 1, "cpus": "", "containers": 0},
            ],
            "containers": 0,
        },
        "containers": [],
        "pods": [],
        "heals": [
            {
                "at": "2025-11-27T09:58:30Z",
                "kind": "pod_gone",
                "message": "pod gone: its books and device bindings are dropped",
                "why": "its cgroup directory is gone",
                "pod_key": "uid-1",
                "container_id": None,
            },
            {
                "at": "2025-11-27T09:55:00Z",
                "kind": "pod_quota",
                "message": "pod quota was off its target: brought back",
                "why": "changed behind the plugin's back",
                "pod_key": "uid-2",
                "container_id": None,
                "namespace": "shop",
                "pod": "web-0",
            },
        ],
    }
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    assert render_table(document).splitlines() == [
        "mixed-cpu-nri-plugin 0.1.0, pid 7, at 2025-11-27T10:00:00Z",
        "runtime        backing_off: no runtime has configured the plugin yet",
        "device plugin  off",
        "pod resources  not asked: neither the device plugin nor DRA hands out devices to ask kubelet about",
        "DRA            off",
        "shared pool    0,4: 0 containers",
        "  NUMA node 0  0: 0 containers",
        "  NUMA node 1  none (its containers get the whole pool): 0 containers",
        "",
        "SHARED CONTAINERS (0)",
        "(none)",
        "",
        "POD QUOTAS (0, in CPUs: quota / period)",
        "(none)",
        "",
        "LATEST HEALS (2)",
        "AGO    KIND       POD         CONTAINER ID  WHAT",
        "1m30s  pod_gone   uid uid-1   -             pod gone: its books and device bindings are dropped",
        "5m0s   pod_quota  shop/web-0  -             pod quota was off its target: brought back",
    ]

    # A daemon older than the dra section: its document is still v1, and its table has no DRA line.
    del document["dra"]
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    assert not any(line.startswith("DRA") for line in render_table(document).splitlines())


def test_the_table_says_when_and_why_the_runtime_connection_was_lost_and_a_stall() -> None:
    """After a lost connection, a line under the runtime's: when (and how long ago), why, and the
    state now; a connection stuck between attempts says so on the runtime's line (issue 31)."""
    runtime = {
        "state": "registered",
        "name": "containerd",
        "version": "v2.3.4",
        "nri_version": None,
        "connected_since": "2025-11-27T09:59:20Z",
        "connections": 2,
        "synchronizations": 1,
        "last_lost": {"cause": "the runtime closed the connection", "at": "2025-11-27T09:59:18Z"},
        "stalled_seconds": 40,
    }
    document = _minimal_document(runtime=runtime)
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    assert render_table(document).splitlines()[1:3] == [
        "runtime        containerd v2.3.4: registered, connected 40s ago; STUCK for 40s: neither serving "
        "nor waiting to reconnect",
        "  connection   lost 2025-11-27T09:59:18Z (42s ago): the runtime closed the connection; "
        "now registered",
    ]
    # Serving again: the last loss stays in sight, and nothing is stuck.
    runtime.update(state="ready", stalled_seconds=0)
    assert render_table(document).splitlines()[1:3] == [
        "runtime        containerd v2.3.4: ready, connected 40s ago",
        "  connection   lost 2025-11-27T09:59:18Z (42s ago): the runtime closed the connection; now ready",
    ]
    # A loss without a cause, or an "at" that is no time, is no document of ours.
    for bad in ({"cause": "", "at": "2025-11-27T09:59:18Z"}, {"cause": "x", "at": "yesterday"}):
        runtime["last_lost"] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft202012Validator(SCHEMA).validate(document)
    # An older daemon's document has neither field: one runtime line, as before.
    del runtime["last_lost"], runtime["stalled_seconds"]
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    assert render_table(document).splitlines()[1:3] == [
        "runtime        containerd v2.3.4: ready, connected 40s ago",
        "device plugin  off",
    ]


def _minimal_document(**parts: Any) -> dict[str, Any]:
    """A status document of a node with no runtime yet and nothing shared, with `parts` put in."""
    return {
        "schema": "mixed-cpu-nri-plugin/status/v1",
        "version": "0.1.0",
        "time": "2025-11-27T10:00:00Z",
        "daemon": {
            "pid": 7,
            "config": "/etc/mixed-cpu-nri/config.toml",
            "state_dir": "/var/lib/mixed-cpu-nri",
        },
        "runtime": {
            "state": "connecting",
            "name": None,
            "version": None,
            "nri_version": None,
            "connected_since": None,
            "connections": 0,
            "synchronizations": 0,
        },
        "device_plugin": {
            "enabled": False,
            "state": None,
            "resource_name": None,
            "registered": False,
            "registrations": 0,
        },
        "pod_resources": {"configured": False, "socket": None, "reachable": None, "proof": None},
        "pool": {"cpus": "0-1", "numa_local": False, "numa_nodes": [], "containers": 0},
        "containers": [],
        "pods": [],
        "heals": [],
        **parts,
    }


def _dra_section(**changes: Any) -> dict[str, Any]:
    section: dict[str, Any] = {
        "enabled": True,
        "driver": "shared-cpus.mixed-cpu.openshift.io",
        "node": "node-1",
        "kubelet": {
            "registered": True,
            "registrations": 1,
            "last_error": None,
            "registration_socket": "/var/lib/kubelet/plugins_registry/shared-cpus-reg.sock",
            "endpoint": "/var/lib/kubelet/plugins/shared-cpus/dra.sock",
        },
        "resource_slices": {
            "published_here": True,
            "published": True,
            "generation": 2,
            "devices": 256,
            "failures": 0,
            "last_error": None,
            "restores": 0,
        },
        "prepared_claims": {"count": 3, "capped": False, "read_error": None},
    }
    for part, values in changes.items():
        section[part] = {**section[part], **values}
    return section


@pytest.mark.parametrize(
    ("changes", "lines"),
    [
        (
            {},
            [
                "DRA            shared-cpus.mixed-cpu.openshift.io on node node-1",
                "  kubelet      registered (1 registration)",
                "  slices       published: generation 2, 256 devices",
                "  claims       3 prepared",
            ],
        ),
        (
            {"resource_slices": {"generation": 4, "restores": 2}},  # kubelet wiped them twice
            [
                "DRA            shared-cpus.mixed-cpu.openshift.io on node node-1",
                "  kubelet      registered (1 registration)",
                "  slices       published: generation 4, 256 devices, restored 2 times",
                "  claims       3 prepared",
            ],
        ),
        (
            {
                "kubelet": {"registered": False, "registrations": 0},
                "resource_slices": {"published": False, "generation": None},
                "prepared_claims": {"count": 10000, "capped": True},
            },
            [
                "DRA            shared-cpus.mixed-cpu.openshift.io on node node-1",
                "  kubelet      NOT registered (0 registrations): waiting for kubelet's plugin watcher",
                "  slices       publishing",
                "  claims       10000 or more prepared",
            ],
        ),
        (
            {
                "kubelet": {"registered": False, "registrations": 2, "last_error": "driver name taken"},
                "resource_slices": {
                    "published": False,
                    "failures": 3,
                    "last_error": "no service account token",
                },
                "prepared_claims": {
                    "count": None,
                    "read_error": "cannot list /var/run/cdi: Permission denied",
                },
            },
            [
                "DRA            shared-cpus.mixed-cpu.openshift.io on node node-1",
                "  kubelet      REFUSED (2 registrations): driver name taken",
                "  slices       NOT published (3 failed attempts, retrying): no service account token",
                "  claims       ? (cannot list /var/run/cdi: Permission denied)",
            ],
        ),
        (
            {
                "resource_slices": {
                    "published_here": False,
                    "published": None,
                    "generation": None,
                    "devices": None,
                    "failures": None,
                    "restores": None,
                },
            },
            [
                "DRA            shared-cpus.mixed-cpu.openshift.io on node node-1",
                "  kubelet      registered (1 registration)",
                "  slices       not published by this daemon (publish_resource_slices = false)",
                "  claims       3 prepared",
            ],
        ),
    ],
)
def test_the_table_shows_the_dra_front_door(changes: dict[str, Any], lines: list[str]) -> None:
    section = _dra_section(**changes)
    document = _minimal_document(dra=section)
    jsonschema.Draft202012Validator(SCHEMA).validate(document)
    table = render_table(document).splitlines()
    start = table.index(lines[0])
    assert table[start : start + len(lines)] == lines
    assert table[start - 1].startswith("pod resources")


# -- escape sequences in the document ----------------------------------------------------------------

_HOSTILE = "web-\x1b]0;owned\x07\x1b[2J\x9b31m\u202eevil\x7f\nnext"
_HOSTILE_SHOWN = r"web-\x1b]0;owned\x07\x1b[2J\x9b31m\u202eevil\x7f\nnext"


def _hostile_document() -> dict[str, Any]:
    """A document whose strings (the runtime's name, a container's pod, namespace and name, a heal's
    message) carry escape sequences: a title change, a screen clear, a C1 CSI, a right-to-left
    override, DEL and a newline."""
    base = _minimal_document()
    container = {
        "namespace": _HOSTILE,
        "pod": _HOSTILE,
        "pod_key": "uid-1",
        "container": _HOSTILE,
        "exclusive_cpus": "2",
        "shared_cpus": "0-1",
        "proof": "marker",
        "device": None,
        "since": "2025-11-27T09:00:00Z",
    }
    heal = {
        "at": "2025-11-27T09:58:30Z",
        "kind": "pod_gone",
        "message": _HOSTILE,
        "why": "",
        "pod_key": "uid-1",
        "container_id": None,
    }
    return {
        **base,
        "runtime": {**base["runtime"], "name": _HOSTILE, "version": "v2", "state": "synchronized"},
        "containers": [container],
        "heals": [heal],
    }


def _raw_controls(text: str) -> set[str]:
    """The characters in `text` a terminal would act on (the line ends apart)."""
    return {char for char in text if not char.isprintable() and char != "\n"}


@pytest.mark.asyncio
@pytest.mark.parametrize("output", ["table", "json"])
async def test_escape_sequences_in_the_document_reach_the_terminal_escaped(
    short_dir: Path, output: str
) -> None:
    """The daemon's own server and the command: nothing a terminal acts on is printed raw."""
    path = str(short_dir / "status.sock")
    server = StatusServer(path, _hostile_document)
    await server.start()
    out, err = io.StringIO(), io.StringIO()
    try:
        code = await asyncio.wait_for(
            asyncio.to_thread(lambda: run_status(socket=path, output=output, out=out, err=err)), GUARD
        )
    finally:
        await server.close()
    assert code == 0, err.getvalue()
    printed = out.getvalue()
    assert _raw_controls(printed) == set()
    if output == "json":
        assert json.loads(printed) == _hostile_document(), "escaped as JSON, read back the same"
        return
    shown = _HOSTILE_SHOWN
    rows = printed.splitlines()
    assert any(row.startswith(f"runtime        {shown} v2: synchronized") for row in rows), rows
    container = next(row for row in rows if row.startswith(shown))
    assert container.split() == [shown, shown, shown, "2", "0-1", "marker", "-", "1h0m"]
    assert rows[-1].endswith(f"pod_gone  uid uid-1  -             {shown}")
