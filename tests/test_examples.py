"""The files under examples/ are true: the config sets every key the daemon knows and parses; the pod
specs ask the way the plugin honours, and the wrong one fails with the message its comment quotes (from
the real device plugin and the real plugin behind the runtime simulator); the demo workload pins its
threads where it says and fails with one line when it has nothing to pin to."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, fields
from decimal import Decimal
from pathlib import Path
from types import ModuleType
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

import pytest
import yaml
from mixedcpu_support import (
    PERIOD,
    FakeCgroups,
    Naming,
    make_container,
    make_plugin,
    make_pod,
    plugin_running,
)

from nri_plugin.api.deviceplugin.v1beta1 import api_pb2 as dp
from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import format_cpuset, parse_cpuset
from nri_plugin.daemon import config as config_module

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10 only
    import tomli as tomllib
from nri_plugin.deviceplugin.config import DEFAULT_DEVICE_COUNT, DevicePluginConfig
from nri_plugin.deviceplugin.server import AllocationError, allocate, device_ids
from nri_plugin.dra.config import DraConfig
from nri_plugin.mixedcpu.policy import ISOLATED_ENV, REQUEST_RESOURCE, SHARED_ENV
from nri_plugin.nri.simulator import PluginFailed, RuntimeSimulator, env_of

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CONFIG = EXAMPLES / "config.toml"
DEMO = EXAMPLES / "workload" / "shared_cpus_demo.py"
POD_FILES = sorted(EXAMPLES.rglob("*.yaml"))
GUARD = 30.0


# -- config.toml -----------------------------------------------------------------------------------------


def _known_keys() -> dict[str, set[str]]:
    """The keys the config module accepts, per table ("" is the top level), from the module itself."""
    tables = {config_module._SOURCES_TABLE, config_module._DEVICE_PLUGIN_TABLE, config_module._DRA_TABLE}
    return {
        "": set(config_module._TOP_KEYS) - tables,
        config_module._SOURCES_TABLE: set(config_module._SOURCE_KEYS),
        config_module._DEVICE_PLUGIN_TABLE: {f.name for f in fields(DevicePluginConfig)},
        config_module._DRA_TABLE: {f.name for f in fields(DraConfig)},
    }


def test_config_example_sets_every_known_key() -> None:
    document = tomllib.loads(CONFIG.read_text(encoding="utf-8"))
    known = _known_keys()
    tables = {name: value for name, value in document.items() if isinstance(value, dict)}
    assert set(tables) == set(known) - {""}
    assert {name for name in document if name not in tables} == known[""]
    for table, keys in known.items():
        if table:
            assert set(tables[table]) == keys, f"[{table}]"


def test_config_example_loads_and_shows_the_defaults() -> None:
    config = config_module.load_config(CONFIG, check=False)  # check=False: this machine's CPUs differ
    assert config == config_module.parse_config(
        tomllib.loads(CONFIG.read_text(encoding="utf-8")), source=str(CONFIG)
    )
    assert config.shared_cpuset_text == "0-1"
    # Every other value is the default, so the file documents the defaults truthfully.
    assert config == config_module.Config(shared_cpuset=config.shared_cpuset, source=str(CONFIG))


def test_config_example_comments_every_key_and_table() -> None:
    lines = CONFIG.read_text(encoding="utf-8").splitlines()
    entries = [i for i, line in enumerate(lines) if re.match(r"(\[\w+\]|\w+ =)", line)]
    assert len(entries) == sum(len(keys) for keys in _known_keys().values()) + len(_known_keys()) - 1
    for i in entries:
        block = []
        j = i - 1
        while j >= 0 and lines[j].startswith("#"):
            block.append(lines[j].lstrip("# "))
            j -= 1
        assert len(" ".join(block)) >= 40, f"line {i + 1} ({lines[i]!r}) needs a comment above it"


# -- pod specs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodDoc:
    path: Path
    spec: dict[str, Any]
    errors: tuple[str, ...]  # the messages quoted on "# error: " lines: this pod is meant to fail

    @property
    def name(self) -> str:
        return str(self.spec["metadata"]["name"])

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.name}"


def _pod_docs() -> list[PodDoc]:
    docs = []
    for path in POD_FILES:
        for chunk in re.split(r"^---[ \t]*$", path.read_text(encoding="utf-8"), flags=re.MULTILINE):
            errors = tuple(re.findall(r"^# error: (.+)$", chunk, flags=re.MULTILINE))
            docs.append(PodDoc(path, yaml.safe_load(chunk), errors))
    return docs


POD_DOCS = _pod_docs()
GOOD_DOCS = [doc for doc in POD_DOCS if not doc.errors]
WRONG_DOCS = [doc for doc in POD_DOCS if doc.errors]


def _milli_cpu(quantity: object) -> int:
    text = str(quantity)
    return int(text[:-1]) if text.endswith("m") else int(Decimal(text) * 1000)


def _resources(container: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    resources = container.get("resources") or {}
    return resources.get("requests") or {}, resources.get("limits") or {}


def _qos_class(pod: dict[str, Any]) -> str:
    """The pod's QoS class, by kubelet's rules (only CPU and memory count)."""
    containers = pod["spec"]["containers"]
    compute = ("cpu", "memory")
    if not any(name in r for c in containers for r in _resources(c) for name in compute):
        return "BestEffort"
    for container in containers:
        requests, limits = _resources(container)
        for name in compute:
            # A request left out defaults to the limit.
            if name not in limits or str(requests.get(name, limits[name])) != str(limits[name]):
                return "Burstable"
    return "Guaranteed"


def _asks(container: dict[str, Any]) -> int | None:
    requests, limits = _resources(container)
    if REQUEST_RESOURCE not in requests and REQUEST_RESOURCE not in limits:
        return None
    # The API server requires an extended resource's request to equal its limit.
    assert requests.get(REQUEST_RESOURCE) == limits.get(REQUEST_RESOURCE), container["name"]
    return int(limits[REQUEST_RESOURCE])


def test_pod_files_are_found() -> None:
    names = {p.relative_to(EXAMPLES).as_posix() for p in POD_FILES}
    assert {
        "pods/guaranteed-shared.yaml",
        "pods/two-containers.yaml",
        "pods/wrong-request.yaml",
        "workload/pod.yaml",
    } <= names
    assert len(WRONG_DOCS) >= 2


@pytest.mark.parametrize("doc", POD_DOCS, ids=str)
def test_pod_spec_is_a_pod_with_named_containers(doc: PodDoc) -> None:
    spec = doc.spec
    assert (spec["apiVersion"], spec["kind"]) == ("v1", "Pod")
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc.name)
    containers = spec["spec"]["containers"]
    assert containers
    assert len({c["name"] for c in containers}) == len(containers)
    assert all(container["image"] for container in containers)
    assert any(_asks(container) is not None for container in containers)


@pytest.mark.parametrize("doc", GOOD_DOCS, ids=str)
def test_good_pod_spec_asks_the_way_the_plugin_honours(doc: PodDoc) -> None:
    assert _qos_class(doc.spec) == "Guaranteed"
    for container in doc.spec["spec"]["containers"]:
        requests, limits = _resources(container)
        assert requests == limits, container["name"]
        if _asks(container) is not None:
            assert _asks(container) == 1, container["name"]
            assert _milli_cpu(limits["cpu"]) % 1000 == 0, f"{container['name']}: whole CPUs"


def test_two_container_pod_has_one_asking_container() -> None:
    (doc,) = [d for d in POD_DOCS if d.path.name == "two-containers.yaml"]
    asking = [c["name"] for c in doc.spec["spec"]["containers"] if _asks(c)]
    assert len(asking) == 1
    assert len(doc.spec["spec"]["containers"]) == 2


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="mcpu-ex-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


NODE_CPUS = frozenset(range(8))
NODE_SHARED = frozenset({0, 1})  # shared_cpuset, also kubelet's reservedSystemCPUs


class Refused(Exception):
    """What kubelet or the runtime would report for the pod, and where."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message


@dataclass
class Placed:
    container: api.Container
    exclusive: frozenset[int]
    asks: bool


async def _admit_and_create(root: Path, spec: dict[str, Any], namespace: str = "default") -> list[Placed]:
    """Do with a pod spec what kubelet (static CPU manager), the device plugin and the runtime do, with the
    real device plugin `allocate` and the real NRI plugin behind the runtime simulator."""
    naming = Naming("containerd", "systemd")
    tree = FakeCgroups(root / "cgroup", 2)
    plugin, key = make_plugin(root / "state", tree.layout, NODE_SHARED)
    known = frozenset(device_ids(DEFAULT_DEVICE_COUNT))
    containers = spec["spec"]["containers"]
    qos = _qos_class(spec)

    # Admission: kubelet asks the device plugin for the devices of every asking container.
    next_device = 0
    annotations: dict[str, dict[str, str]] = {}
    for container in containers:
        count = _asks(container)
        if count is None:
            continue
        ids = sorted(known)[next_device : next_device + count]
        next_device += count
        request = dp.AllocateRequest()
        request.container_requests.add().devices_ids.extend(ids)
        try:
            response = allocate(request, known=known, key=key, resource_name=REQUEST_RESOURCE)
        except AllocationError as exc:
            raise Refused("admission", exc.args[0]) from None
        annotations[container["name"]] = dict(response.container_responses[0].annotations)

    pod = make_pod(
        naming, "5e1f-77ab", qos="" if qos == "Guaranteed" else qos.lower(), name=spec["metadata"]["name"]
    )
    pod.namespace = namespace
    limits = [_resources(c)[1].get("cpu") for c in containers]
    tree.add_pod(pod, None if None in limits else sum(_milli_cpu(q) for q in limits) * PERIOD // 1000)

    free = sorted(NODE_CPUS - NODE_SHARED)
    placed: list[Placed] = []
    socket = root / "nri.sock"
    async with RuntimeSimulator(socket) as sim, plugin_running(plugin, socket):
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(pod)
        for n, container in enumerate(containers):
            requests, limits_ = _resources(container)
            milli = _milli_cpu(requests.get("cpu", limits_.get("cpu", "0")))
            exclusive: frozenset[int] = frozenset()
            if qos == "Guaranteed" and milli % 1000 == 0:
                exclusive = frozenset(free[: milli // 1000])
                free = free[milli // 1000 :]
            nri = make_container(
                naming,
                pod,
                f"c{n}",
                container["name"],
                # Containers without exclusive CPUs run on the default pool: every CPU not handed out.
                cpus=format_cpuset(exclusive or NODE_CPUS - {c for p in placed for c in p.exclusive}),
                quota=_milli_cpu(limits_["cpu"]) * PERIOD // 1000 if "cpu" in limits_ else None,
                shares=max(2, milli * 1024 // 1000),
                annotations=annotations.get(container["name"]),
            )
            try:
                result = await sim.create_container(nri)
            except PluginFailed as exc:
                raise Refused("create", exc.message) from None
            tree.run_container(result.container)
            placed.append(Placed(result.container, exclusive, container["name"] in annotations))
    return placed


@pytest.mark.asyncio
@pytest.mark.parametrize("doc", GOOD_DOCS, ids=str)
async def test_good_pod_gets_shared_cpus_where_it_asks(short_dir: Path, doc: PodDoc) -> None:
    placed = await _admit_and_create(short_dir, doc.spec)
    assert any(p.asks for p in placed)
    for p in placed:
        cpu, env = p.container.linux.resources.cpu, env_of(p.container)
        assert p.exclusive, p.container.name
        if p.asks:
            assert parse_cpuset(cpu.cpus) == p.exclusive | NODE_SHARED
            assert cpu.quota.value == len(p.exclusive | NODE_SHARED) * PERIOD
            assert env[SHARED_ENV] == format_cpuset(NODE_SHARED)
            assert env[ISOLATED_ENV] == format_cpuset(p.exclusive)
        else:
            assert parse_cpuset(cpu.cpus) == p.exclusive
            assert cpu.quota.value == len(p.exclusive) * PERIOD
            assert SHARED_ENV not in env
            assert ISOLATED_ENV not in env


@pytest.mark.asyncio
@pytest.mark.parametrize("doc", WRONG_DOCS, ids=str)
async def test_wrong_pod_fails_with_the_quoted_message(short_dir: Path, doc: PodDoc) -> None:
    (quoted,) = doc.errors
    namespace = "team-a"
    with pytest.raises(Refused) as info:
        await _admit_and_create(short_dir, doc.spec, namespace)
    assert info.value.message == quoted.replace("<namespace>", namespace)
    # The comment tells the user where to look, which depends on where it fails.
    text = doc.path.read_text(encoding="utf-8")
    chunk = next(c for c in text.split("\n---\n") if quoted in c)
    expected_state = "UnexpectedAdmissionError" if info.value.stage == "admission" else "CreateContainerError"
    assert expected_state in chunk


# -- the demo workload --------------------------------------------------------------------------------


def _load_demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shared_cpus_demo", DEMO)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_is_standard_library_python_3_9() -> None:
    tree = ast.parse(DEMO.read_text(encoding="utf-8"), feature_version=(3, 9))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}


def test_demo_cpu_lists_round_trip() -> None:
    demo = _load_demo()
    for text in ("0", "0-1", "0-1,50", "3,5-7,9", "0-2,4-6"):
        cpus = demo.parse_cpu_list(text)
        assert cpus == parse_cpuset(text)
        assert demo.format_cpu_list(cpus) == format_cpuset(cpus)
    for bad in ("", "1-", "-1", "2-1", "a", "1,,2", "1 2", "0-99999999"):
        with pytest.raises(ValueError):  # noqa: PT011 (the demo's parser raises bare ValueError)
            demo.parse_cpu_list(bad)


def test_demo_options_in_the_pod_and_image_are_valid() -> None:
    parser = _load_demo().build_parser()
    (pod,) = [d for d in POD_DOCS if d.path == EXAMPLES / "workload" / "pod.yaml"]
    (container,) = pod.spec["spec"]["containers"]
    args = parser.parse_args(container["args"])
    assert args.busy_threads <= _milli_cpu(container["resources"]["limits"]["cpu"]) // 1000
    dockerfile = (EXAMPLES / "workload" / "Dockerfile").read_text(encoding="utf-8")

    def instruction(name: str) -> str:
        match = re.search(rf"^{name} (.+)$", dockerfile, flags=re.MULTILINE)
        assert match is not None, name
        return match.group(1)

    source, target = instruction("COPY").split()
    assert (EXAMPLES / "workload" / source).is_file()
    assert json.loads(instruction("ENTRYPOINT"))[-1] == target
    parser.parse_args(json.loads(instruction("CMD")))


def _run_demo(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in (SHARED_ENV, ISOLATED_ENV)}
    return subprocess.run(
        [sys.executable, str(DEMO), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )


ALLOWED = frozenset(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(
    len(ALLOWED) < 2, reason="needs 2 CPUs this process may use: one shared, one isolated"
)


def _split() -> tuple[frozenset[int], frozenset[int]]:
    """This machine's allowed CPUs as a node would split them: the first shared, the rest isolated."""
    shared = frozenset({min(ALLOWED)})
    return shared, ALLOWED - shared


@needs_two_cpus
def test_demo_pins_busy_threads_to_isolated_and_light_threads_to_shared() -> None:
    shared, isolated = _split()
    env = {SHARED_ENV: format_cpuset(shared), ISOLATED_ENV: format_cpuset(isolated)}
    result = _run_demo(env, "--seconds", "0.3", "--busy-threads", "2", "--light-threads", "3", "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    report = json.loads(result.stdout)
    assert report["shared_cpus"] == sorted(shared)
    assert report["isolated_cpus"] == sorted(isolated)
    assert report["process_allowed_cpus"] == sorted(ALLOWED)
    threads = report["threads"]
    assert sorted(t["kind"] for t in threads) == ["busy"] * 2 + ["light"] * 3
    assert len({t["tid"] for t in threads}) == len(threads)
    for thread in threads:
        wanted = isolated if thread["kind"] == "busy" else shared
        # Each thread still has its own set once all of them have pinned themselves.
        assert thread["allowed"] == sorted(wanted), thread["name"]
        observed = {int(cpu) for cpu in thread["ran_on"]}
        assert observed, thread["name"]
        assert observed <= wanted, thread["name"]
        assert all(count > 0 for count in thread["ran_on"].values())


@needs_two_cpus
def test_demo_text_report_lists_every_thread() -> None:
    shared, isolated = _split()
    env = {SHARED_ENV: format_cpuset(shared), ISOLATED_ENV: format_cpuset(isolated)}
    result = _run_demo(env, "--seconds", "0.2", "--busy-threads", "1", "--light-threads", "1")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[3:]}
    assert set(rows) == {"poll-0", "housekeeping-0"}
    assert rows["poll-0"][3] == format_cpuset(isolated)
    assert rows["housekeeping-0"][3] == format_cpuset(shared)


def _other_cpu() -> int:
    return max(ALLOWED) + 1  # not in this process's allowed set


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({}, [ISOLATED_ENV, "is not set", REQUEST_RESOURCE]),
        ({ISOLATED_ENV: "0"}, [SHARED_ENV, "is not set", REQUEST_RESOURCE]),
        ({ISOLATED_ENV: "4-", SHARED_ENV: "0"}, [f"{ISOLATED_ENV}='4-' is not a CPU list"]),
        ({ISOLATED_ENV: "0", SHARED_ENV: "1-0"}, [f"{SHARED_ENV}='1-0' is not a CPU list"]),
        ({ISOLATED_ENV: "", SHARED_ENV: "0"}, [f"{ISOLATED_ENV}='' is not a CPU list"]),
        (
            {ISOLATED_ENV: str(min(ALLOWED)), SHARED_ENV: str(_other_cpu())},
            [f"{SHARED_ENV} lists CPUs {_other_cpu()},", format_cpuset(ALLOWED), REQUEST_RESOURCE],
        ),
        (
            {ISOLATED_ENV: str(_other_cpu()), SHARED_ENV: str(min(ALLOWED))},
            [f"{ISOLATED_ENV} lists CPUs {_other_cpu()},", "did not get the node's shared CPUs"],
        ),
        (
            {ISOLATED_ENV: "0-1", SHARED_ENV: "1"},
            [f"{ISOLATED_ENV} and {SHARED_ENV} both list CPUs 1"],
        ),
    ],
    ids=[
        "none",
        "no-shared",
        "malformed-isolated",
        "reversed-range",
        "empty",
        "shared-not-allowed",
        "isolated-not-allowed",
        "overlap",
    ],
)
def test_demo_refuses_with_one_line_and_status_2(env: dict[str, str], words: list[str]) -> None:
    result = _run_demo(env, "--seconds", "0.1")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, shlex.quote(result.stderr)
    assert result.stderr.startswith("shared_cpus_demo: error: ")
    for word in words:
        assert word in result.stderr
