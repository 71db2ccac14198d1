"""What ships under packaging/: the image recipe, the kustomize base and overlays, the Helm chart, the
runtime drop-ins, the systemd unit and the runtime-launched wrapper.

The manifests are checked against the daemon itself: the config each one carries must pass
`parse_config`, and the DaemonSet must mount exactly the paths that config names (the NRI socket's
directory, the cgroup root, kubelet's device-plugin directory, the state dir) and probe the port it
listens on. Rendering uses the real tools when they are present: ``kubectl kustomize`` for the
overlays, ``helm`` ($HELM or on PATH) for the chart. .ci/run installs Helm and sets
MIXED_CPU_REQUIRE_HELM=1, which turns a missing Helm into a failure instead of a skip.
"""

from __future__ import annotations

import asyncio
import configparser
import dataclasses
import json
import os
import posixpath
import re
import shlex
import shutil
import socket
import subprocess
import sys
import urllib.parse
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError
from mixedcpu_support import ROOT, write_daemon_config

from nri_plugin.daemon.config import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_NRI_SOCKET,
    DEFAULT_STATE_DIR,
    Config,
    parse_config,
)
from nri_plugin.daemon.enable_nri import CONTAINERD_CONFIG, CRIO_DROP_IN, NRI_SOCKET
from nri_plugin.daemon.wiring import LAUNCHED_ENDED
from nri_plugin.deviceplugin.config import DEFAULT_PLUGIN_DIR
from nri_plugin.dra import slices as dra_slices
from nri_plugin.dra.config import DEFAULT_DRIVER_NAME as DRIVER
from nri_plugin.nri.simulator import RuntimeSimulator
from nri_plugin.systemd.bus import SYSTEM_BUS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10 only
    import tomli as tomllib

PACKAGING = ROOT / "packaging"
KUSTOMIZE = PACKAGING / "kubernetes"
OVERLAYS = ("containerd", "cri-o", "openshift")
CHART = PACKAGING / "helm" / "mixed-cpu-nri-plugin"
RUNTIME = PACKAGING / "runtime"
UNIT = PACKAGING / "systemd" / "mixed-cpu-nri-plugin.service"
LAUNCHED = PACKAGING / "nri-launched"
CONFIG_DIR = posixpath.dirname(DEFAULT_CONFIG_PATH)
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
[CONSOLE_SCRIPT] = PYPROJECT["project"]["scripts"]
HOST_VENV = "/opt/mixed-cpu-nri-plugin"  # where the image and the host install both put the venv
GUARD = 20.0
TOLERATION_KEY = "tolerate-missing-nri-plugins.noderesource.dev"
IMAGE = "registry.example.com/you/mixed-cpu-nri-plugin"

Doc = dict[str, Any]


# -- helpers ---------------------------------------------------------------------------------------


def load_documents(text: str) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def one(docs: list[Doc], kind: str) -> Doc:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def config_of(docs: list[Doc]) -> Config:
    """The daemon's config carried by the rendered ConfigMap, checked by the daemon's own parser."""
    config_map = one(docs, "ConfigMap")
    return parse_config(tomllib.loads(config_map["data"]["config.toml"]), source="ConfigMap")


def metrics_host_port(config: Config) -> tuple[str, int]:
    host, _, port = config.metrics_address.rpartition(":")
    return host.strip("[]"), int(port)


def check_daemonset(docs: list[Doc]) -> Doc:
    """The invariants every rendering of the DaemonSet keeps; returns the DaemonSet."""
    config = config_of(docs)
    config_map = one(docs, "ConfigMap")
    ds = one(docs, "DaemonSet")
    pod = ds["spec"]["template"]
    spec = pod["spec"]
    [container] = spec["containers"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["nodeSelector"]["kubernetes.io/os"] == "linux"
    assert spec["tolerations"], "node-level infrastructure: tolerate taints"
    assert pod["metadata"]["annotations"][TOLERATION_KEY] == "true"
    # A token only for DRA, which talks to the API server (ResourceSlices, ResourceClaims).
    assert spec["automountServiceAccountToken"] is config.dra.enabled
    assert spec["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]

    # The command reads the mounted ConfigMap's config.toml.
    args = container["args"]
    assert args[0] == "run"
    assert args[args.index("--config") + 1] == DEFAULT_CONFIG_PATH
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    config_volume = volumes[mounts[CONFIG_DIR]["name"]]
    assert config_volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert mounts[CONFIG_DIR]["readOnly"] is True

    # Host paths: directories only, each mounted where the config expects it.
    host_paths = {v["hostPath"]["path"]: v for v in volumes.values() if "hostPath" in v}
    for path, volume in host_paths.items():
        assert not path.endswith(".sock"), f"{path}: mount the directory, not the socket file"
        assert volume["hostPath"]["type"] in ("Directory", "DirectoryOrCreate"), path

    def mounted_at(host_path: str) -> Doc:
        name = host_paths[host_path]["name"]
        mounts: list[Doc] = [m for m in container["volumeMounts"] if m["name"] == name]
        [mount] = mounts
        return mount

    nri_dir = posixpath.dirname(config.nri_socket)
    assert mounted_at("/var/run/nri")["mountPath"] == nri_dir == "/var/run/nri"
    assert host_paths["/var/run/nri"]["hostPath"]["type"] == "Directory", "made by the runtime (0700)"
    assert mounted_at("/sys/fs/cgroup")["mountPath"] == config.cgroup_root
    assert not mounted_at("/sys/fs/cgroup").get("readOnly", False), "the plugin writes cgroup files"
    state = mounted_at(config.state_dir)
    assert state["mountPath"] == config.state_dir
    assert not state.get("readOnly", False)
    assert host_paths[config.state_dir]["hostPath"]["type"] == "DirectoryOrCreate"
    # The system bus's directory, where the config looks for its socket: pod quotas of systemd
    # slices go through systemd (issue 12).
    bus_dir = posixpath.dirname(config.systemd_bus)
    assert config.systemd_bus == SYSTEM_BUS
    assert mounted_at(bus_dir)["mountPath"] == bus_dir
    assert mounted_at(bus_dir)["readOnly"] is True
    if config.device_plugin.enabled:
        plugin_dir = str(config.device_plugin.plugin_dir)
        assert mounted_at(plugin_dir)["mountPath"] == plugin_dir
    else:
        assert str(DEFAULT_PLUGIN_DIR) not in host_paths
    kubelet_dra_dirs = {
        str(config.dra.registry_dir),
        posixpath.join(str(config.dra.plugins_dir), config.dra.driver_name),
        str(config.dra.cdi_dir),
    }
    if config.dra.enabled:
        # kubelet's plugin watcher, our own service socket's directory (not the other plugins'), and
        # where the runtime reads CDI specs: each at the path the config names.
        for path in kubelet_dra_dirs:
            assert mounted_at(path)["mountPath"] == path
            assert host_paths[path]["hostPath"]["type"] == "DirectoryOrCreate"
        assert str(config.dra.plugins_dir) not in host_paths
        assert not config.dra.node_name, "the node name comes from NODE_NAME"
        assert {e["name"]: e for e in container["env"]}["NODE_NAME"]["valueFrom"] == {
            "fieldRef": {"fieldPath": "spec.nodeName"}
        }
    else:
        assert not kubelet_dra_dirs & set(host_paths)
    if config.device_plugin.enabled or config.dra.enabled:
        assert mounted_at("/var/lib/kubelet/pod-resources")["readOnly"] is True

    # Least privilege: root for the root-owned host objects, and nothing else.
    security = container["securityContext"]
    assert security["runAsUser"] == 0
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert "/tmp" in mounts, "a writable /tmp beside the read-only root filesystem"

    resources = container["resources"]
    assert set(resources["requests"]) >= {"cpu", "memory"}
    assert "memory" in resources["limits"]
    assert "cpu" not in resources["limits"], "CFS throttling would delay NRI replies"

    # Probes reach the address the daemon listens on.
    host_network = spec.get("hostNetwork", False)
    if config.metrics_address:
        host, port = metrics_host_port(config)
        [port_spec] = container["ports"]
        assert port_spec["containerPort"] == port
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            http = container[probe]["httpGet"]
            assert http["path"] == path
            assert http["port"] in (port, port_spec["name"])
            if host_network:
                # kubelet runs in the host's network namespace: it can reach the node's loopback.
                assert host == http["host"] == "127.0.0.1"
            else:
                # kubelet probes the pod IP: a loopback listener inside the pod would never answer.
                assert "host" not in http
                assert host in ("0.0.0.0", "::"), host
        if not host_network and "prometheus.io/port" in pod["metadata"]["annotations"]:
            assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    else:
        assert "livenessProbe" not in container
        assert "readinessProbe" not in container
    return ds


# -- kustomize ---------------------------------------------------------------------------------------


def kustomize_files() -> list[Path]:
    return sorted(p for p in KUSTOMIZE.rglob("*") if p.is_file())


def test_every_kustomize_file_parses() -> None:
    for path in kustomize_files():
        if path.suffix == ".toml":
            parse_config(tomllib.loads(path.read_text()), source=str(path))
            continue
        assert path.suffix == ".yaml", path
        docs = load_documents(path.read_text())
        assert docs, path
        for doc in docs:
            if isinstance(doc, list):  # a JSON 6902 patch
                assert all({"op", "path"} <= set(op) for op in doc), path
            else:
                assert {"apiVersion", "kind"} <= set(doc), path


def test_kustomizations_name_files_that_exist() -> None:
    for kustomization in KUSTOMIZE.rglob("kustomization.yaml"):
        doc = yaml.safe_load(kustomization.read_text())
        here = kustomization.parent
        named = list(doc.get("resources", [])) + list(doc.get("components", []))
        named += [p["path"] for p in doc.get("patches", []) if "path" in p]
        named += [f for gen in doc.get("configMapGenerator", []) for f in gen.get("files", [])]
        for name in named:
            assert (here / name).exists(), f"{kustomization}: {name}"


def test_base_config_and_namespace() -> None:
    base = KUSTOMIZE / "base"
    config = parse_config(tomllib.loads((base / "config.toml").read_text()))
    assert config.trust_device_plugin_marker
    assert config.device_plugin.enabled
    assert not config.trust_pod_annotation
    labels = yaml.safe_load((base / "namespace.yaml").read_text())["metadata"]["labels"]
    # hostPath volumes are outside the baseline and restricted Pod Security levels.
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


KUBECTL = shutil.which("kubectl")


def kustomize(overlay: str) -> list[Doc]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: cannot render the kustomize overlays")
    result = subprocess.run(
        [KUBECTL, "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return load_documents(result.stdout)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_overlay_renders_a_working_daemonset(overlay: str) -> None:
    docs = kustomize(overlay)
    ds = check_daemonset(docs)
    namespace = one(docs, "Namespace")["metadata"]["name"]
    assert ds["metadata"]["namespace"] == namespace
    assert one(docs, "ConfigMap")["metadata"]["namespace"] == namespace
    security = ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    if overlay == "containerd":
        assert "seLinuxOptions" not in security
    else:
        assert security["seLinuxOptions"] == {"type": "spc_t"}
    assert config_of(docs).trust_pod_annotation == (overlay == "openshift")


def check_openshift_scc(docs: list[Doc], ds: Doc) -> None:
    """The SCC admits exactly this pod, and the pod's service account may use it."""
    scc = one(docs, "SecurityContextConstraints")
    assert "namespace" not in scc["metadata"], "an SCC is cluster-scoped"
    spec = ds["spec"]["template"]["spec"]
    [container] = spec["containers"]
    assert scc["allowPrivilegedContainer"] is False
    assert scc["allowPrivilegeEscalation"] is False
    assert scc["allowHostDirVolumePlugin"] is True
    assert scc["allowHostNetwork"] is spec.get("hostNetwork", False)
    assert scc["requiredDropCapabilities"] == ["ALL"]
    assert scc["allowedCapabilities"] == []
    assert scc["runAsUser"]["type"] == "RunAsAny"  # uid 0
    assert scc["seLinuxContext"]["type"] == "RunAsAny"  # spc_t
    assert container["securityContext"]["seLinuxOptions"] == {"type": "spc_t"}
    kinds = {
        "hostPath" if "hostPath" in v else "configMap" if "configMap" in v else "emptyDir"
        for v in spec["volumes"]
    }
    assert kinds <= set(scc["volumes"])
    role = one(docs, "ClusterRole")
    [rule] = role["rules"]
    assert rule["resources"] == ["securitycontextconstraints"]
    assert rule["verbs"] == ["use"]
    assert rule["resourceNames"] == [scc["metadata"]["name"]]
    binding = one(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["metadata"]["namespace"] == ds["metadata"]["namespace"]
    namespace = ds["metadata"]["namespace"]
    account = {"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": namespace}
    assert binding["subjects"] == [account]


def test_kustomize_openshift_overlay_grants_its_scc() -> None:
    docs = kustomize("openshift")
    check_openshift_scc(docs, one(docs, "DaemonSet"))
    labels = one(docs, "Namespace")["metadata"]["labels"]
    assert labels["security.openshift.io/scc.podSecurityLabelSync"] == "false"
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def check_network_policy(docs: list[Doc], ds: Doc, scrapers: list[Doc]) -> Doc:
    """The NetworkPolicy guards the DaemonSet's pods: nothing may connect but `scrapers`, and they only
    to the port the daemon's probes and metrics listen on (issue 13). Returns it."""
    policy = one(docs, "NetworkPolicy")
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"]["namespace"] == ds["metadata"]["namespace"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]
    assert set(selector) == {"matchLabels"}
    assert selector["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"], "egress is not limited: kubelet, the runtime"
    if not scrapers:
        assert policy["spec"]["ingress"] == [], "nothing scrapes: no pod may connect"
        return policy
    [rule] = policy["spec"]["ingress"]
    # An empty or missing `from` would admit every source.
    assert rule["from"] == scrapers
    _, port = metrics_host_port(config_of(docs))
    assert rule["ports"] == [{"port": port, "protocol": "TCP"}]
    return policy


def network_policies(docs: list[Doc]) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == "NetworkPolicy"]


OPENSHIFT_SCRAPERS = [
    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}
    for namespace in ("openshift-monitoring", "openshift-user-workload-monitoring")
]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_network_policy_where_it_cuts_no_scraper_off(overlay: str) -> None:
    """OpenShift scrapes through its monitoring namespaces only: the policy is on there. The other
    overlays keep the prometheus.io annotations of an unnamed scraper: theirs is left to the operator."""
    docs = kustomize(overlay)
    ds = one(docs, "DaemonSet")
    if overlay == "openshift":
        check_network_policy(docs, ds, OPENSHIFT_SCRAPERS)
    else:
        assert ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert not network_policies(docs)


def test_kustomize_network_policy_component_on_an_overlay(tmp_path: Path) -> None:
    """The component as an operator adds it to the containerd overlay: it guards that overlay's pods."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: cannot render the kustomize overlays")
    overlay = os.path.relpath(KUSTOMIZE / "overlays" / "containerd", tmp_path)  # kustomize: relative only
    component = os.path.relpath(KUSTOMIZE / "components" / "metrics-network-policy", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {overlay}\ncomponents:\n  - {component}\n"
    )
    result = subprocess.run(
        [KUBECTL, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=GUARD, check=False
    )
    assert result.returncode == 0, result.stderr
    docs = load_documents(result.stdout)
    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    check_network_policy(docs, one(docs, "DaemonSet"), scrapers)


# -- Helm --------------------------------------------------------------------------------------------


def values() -> Doc:
    doc: Doc = yaml.safe_load((CHART / "values.yaml").read_text())
    return doc


def template_files() -> list[Path]:
    return sorted((CHART / "templates").iterdir())


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == CHART.name
    assert chart["appVersion"] == PYPROJECT["project"]["version"]
    assert (CHART / "README.md").is_file()


def test_every_template_action_is_closed() -> None:
    for path in template_files():
        text = path.read_text()
        assert text.count("{{") == text.count("}}"), path
        for action in re.findall(r"\{\{-?(.*?)-?\}\}", text, flags=re.S):
            assert "{{" not in action, f"{path}: nested action {action!r}"
        # Every block opened is closed.
        opened = len(re.findall(r"\{\{-?\s*(?:if|with|range|define)\b", text))
        assert opened == len(re.findall(r"\{\{-?\s*end\b", text)), path


def lookup(doc: Any, dotted: str) -> bool:
    for key in dotted.split("."):
        if not isinstance(doc, Mapping) or key not in doc:
            return False
        doc = doc[key]
    return True


def test_every_value_a_template_uses_is_defined() -> None:
    defined = values()
    used = set()
    for path in template_files():
        used |= set(re.findall(r"\.Values\.([A-Za-z0-9_.]+)", path.read_text()))
    assert used
    missing = sorted(name for name in used if not lookup(defined, name.rstrip(".")))
    assert not missing, f"used by templates but not in values.yaml: {missing}"


def test_values_and_schema_agree() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    assert set(values()) == set(schema["properties"])
    assert set(schema["required"]) <= set(values())
    # gojsonschema reports a oneOf/anyOf refusal as a bare "oneOf": the templates check those values.
    text = (CHART / "values.schema.json").read_text()
    assert "oneOf" not in text
    assert "anyOf" not in text
    assert values()["runtime"] in schema["properties"]["runtime"]["enum"]
    # The chart's defaults are the daemon's defaults where both have one.
    defaults = values()
    assert posixpath.join(defaults["hostPaths"]["nriSocketDir"], "nri.sock") == DEFAULT_NRI_SOCKET
    assert defaults["hostPaths"]["stateDir"] == DEFAULT_STATE_DIR
    assert defaults["devicePlugin"]["hostPath"] == str(DEFAULT_PLUGIN_DIR)
    assert defaults["tolerateMissingPluginsAnnotation"] == TOLERATION_KEY


def helm_binary() -> str:
    helm = os.environ.get("HELM") or shutil.which("helm")
    if helm is None or not os.access(helm, os.X_OK):
        if os.environ.get("MIXED_CPU_REQUIRE_HELM") == "1":
            pytest.fail("MIXED_CPU_REQUIRE_HELM=1 but no helm: set HELM or put helm on PATH")
        pytest.skip("helm is not installed (.ci/run installs it; or set HELM): cannot render the chart")
    return helm


# What every install must set (the chart has no default for either: issue 22, item 5).
REQUIRED = ("--set", f"image.repository={IMAGE}", "--set", "sharedCpuset=0-1")


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=GUARD, check=False)


def helm_template(*sets: str) -> list[Doc]:
    args = ["template", "rel", str(CHART), "--namespace", "nri-test", *REQUIRED]
    for item in sets:
        args += ["--set", item]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    return load_documents(result.stdout)


def test_helm_lint_is_clean() -> None:
    result = helm("lint", "--strict", str(CHART), *REQUIRED)
    assert result.returncode == 0, result.stdout + result.stderr


def test_helm_default_render_matches_the_kustomize_base() -> None:
    docs = helm_template()
    ds = check_daemonset(docs)
    # The ResourceQuota lets system-node-critical pods in outside kube-system (issue 15, item 13).
    assert {d["kind"] for d in docs} == {"ServiceAccount", "ConfigMap", "DaemonSet", "ResourceQuota"}
    assert ds["metadata"]["namespace"] == "nri-test"
    config = config_of(docs)
    assert config.shared_cpuset_text == "0-1"
    assert (
        ds["spec"]["template"]["spec"]["containers"][0]["image"]
        == f"{IMAGE}:{values()['image']['tag'] or '0.3.0'}"
    )
    assert not config.trust_pod_annotation
    assert config.device_plugin.enabled
    # The chart's containerd flavour and the kustomize containerd overlay run the same pod.
    if KUBECTL is not None:
        kustomized = one(kustomize("containerd"), "DaemonSet")["spec"]["template"]["spec"]
        spec = ds["spec"]["template"]["spec"]
        assert spec["containers"][0]["securityContext"] == kustomized["containers"][0]["securityContext"]
        assert spec["containers"][0]["resources"] == kustomized["containers"][0]["resources"]
        host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        assert host_paths == {v["hostPath"]["path"] for v in kustomized["volumes"] if "hostPath" in v}


def test_helm_render_with_other_values() -> None:
    docs = helm_template(
        "runtime=openshift",
        "trustedSources.podAnnotation=true",
        "devicePlugin.enabled=false",
        "hostNetwork=true",
        "metrics.port=9100",
        "sharedCpuset=2-3",
        "plugin.index=42",
        "logLevel=debug",
        "image.tag=test",
    )
    ds = check_daemonset(docs)
    check_openshift_scc(docs, ds)
    config = config_of(docs)
    assert config.shared_cpuset_text == "2-3"
    assert config.plugin_index == "42"
    assert config.log_level == "debug"
    assert config.trust_pod_annotation
    assert not config.device_plugin.enabled
    assert config.metrics_address == "127.0.0.1:9100"
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["containers"][0]["image"].endswith(":test")


def test_helm_render_without_metrics_has_no_probes() -> None:
    docs = helm_template("metrics.enabled=false", "runtime=cri-o", "metrics.bindHost=::")
    ds = check_daemonset(docs)
    assert config_of(docs).metrics_address == ""
    container = ds["spec"]["template"]["spec"]["containers"][0]
    assert "ports" not in container
    assert container["securityContext"]["seLinuxOptions"] == {"type": "spc_t"}
    assert not [d for d in docs if d["kind"] == "SecurityContextConstraints"]


def test_helm_ipv6_bind_address() -> None:
    assert config_of(helm_template("metrics.bindHost=::")).metrics_address == "[::]:8891"


@pytest.mark.parametrize(
    "bad",
    [
        "runtime=docker",
        "metrics.port=0",
        "hostPaths.stateDir=state",
    ],
)
def test_helm_schema_rejects_bad_values(bad: str) -> None:
    result = helm("template", "rel", str(CHART), *REQUIRED, "--set", bad)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["sharedCpuset=0-1"],
            "image.repository is not set: no image is published; build packaging/Dockerfile, push it to a "
            "registry the nodes can pull from, and name it: --set image.repository=",
        ),
        (
            [f"image.repository={IMAGE}"],
            "sharedCpuset is not set: give the node's shared CPUs, a Linux cpu list that is also in "
            "kubelet's reservedSystemCPUs, e.g. --set sharedCpuset=0-1",
        ),
        (
            [f"image.repository={IMAGE}", "sharedCpuset=0-1\\,x"],
            'sharedCpuset "0-1,x" is not a Linux cpu list: write CPU numbers and low-high ranges joined by '
            "commas",
        ),
        (
            [f"image.repository={IMAGE}", "sharedCpuset=-1"],
            'sharedCpuset "-1" is not a Linux cpu list',
        ),
        (
            [f"image.repository={IMAGE}", "sharedCpuset=0-1", "plugin.index=7"],
            "plugin.index=7 is not two digits: NRI orders plugins by a two-digit index from 00 to 99; use "
            "--set plugin.index=10 (any of 10-99), or --set-string plugin.index=07",
        ),
        (
            [f"image.repository={IMAGE}", "sharedCpuset=0-1", "plugin.index=100"],
            "plugin.index=100 is not two digits",
        ),
    ],
    ids=["no-image", "no-cpus", "bad-cpus", "negative-cpus", "index-7", "index-100"],
)
def test_helm_says_what_to_set(sets: list[str], message: str) -> None:
    """No placeholder image and no guessed CPUs: a missing or malformed value is refused with one line
    naming the value, what is wrong, and the --set that fixes it (not a schema "oneOf")."""
    args = ["template", "rel", str(CHART)]
    for item in sets:
        args += ["--set", item]
    result = helm(*args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "oneOf" not in result.stderr
    assert values()["image"]["repository"] == ""
    assert values()["sharedCpuset"] == ""


def test_helm_takes_what_the_messages_advise() -> None:
    assert config_of(helm_template("plugin.index=42")).plugin_index == "42"
    result = helm("template", "rel", str(CHART), *REQUIRED, "--set-string", "plugin.index=07")
    assert result.returncode == 0, result.stderr
    assert config_of(load_documents(result.stdout)).plugin_index == "07"
    assert config_of(helm_template("sharedCpuset=0\\,2\\,4-5")).shared_cpuset_text == "0,2,4-5"


# -- what operators tripped over (issue 15) ----------------------------------------------------------


def env_of(container: Doc) -> dict[str, Doc]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def check_critical_pod_quota(docs: list[Doc], ds: Doc) -> None:
    """The quota admits exactly the DaemonSet's priority class, in its namespace."""
    quota = one(docs, "ResourceQuota")
    assert quota["metadata"]["namespace"] == ds["metadata"]["namespace"]
    [match] = quota["spec"]["scopeSelector"]["matchExpressions"]
    assert (match["scopeName"], match["operator"]) == ("PriorityClass", "In")
    assert match["values"] == [ds["spec"]["template"]["spec"]["priorityClassName"]]
    assert int(quota["spec"]["hard"]["pods"]) > 5000, "more pods than a cluster has nodes"


def test_kustomize_pods_get_their_critical_pod_quota_and_node_name() -> None:
    docs = kustomize("containerd")
    ds = one(docs, "DaemonSet")
    check_critical_pod_quota(docs, ds)
    [container] = ds["spec"]["template"]["spec"]["containers"]
    assert env_of(container)["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_helm_critical_pod_quota_only_where_it_is_needed() -> None:
    docs = helm_template()
    check_critical_pod_quota(docs, one(docs, "DaemonSet"))
    result = helm("template", "rel", str(CHART), "--namespace", "kube-system", *REQUIRED)
    assert result.returncode == 0, result.stderr
    assert not [d for d in load_documents(result.stdout) if d["kind"] == "ResourceQuota"]
    for values in ("priorityClassName=", "criticalPodQuota.create=false"):
        assert not [d for d in helm_template(values) if d["kind"] == "ResourceQuota"], values


def test_helm_takes_a_lone_cpu_as_a_number() -> None:
    """``--set sharedCpuset=0`` makes an integer; it is a one-CPU list all the same."""
    assert config_of(helm_template("sharedCpuset=0")).shared_cpuset_text == "0"
    assert config_of(helm_template("sharedCpuset=0\\,2-3")).shared_cpuset_text == "0,2-3"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["sharedCpuset=3-1"], 'sharedCpuset "3-1": the range 3-1 is reversed'),
        (["sharedCpuset=0\\,5-4"], 'sharedCpuset "0,5-4": the range 5-4 is reversed'),
        (["devicePlugin.enabled=false"], "devicePlugin.enabled=false leaves nothing to prove a request"),
        (
            ["trustedSources.devicePluginMarker=false", "trustedSources.podAnnotation=false"],
            "trustedSources: both sources are off",
        ),
        (["metrics.bindHost=127.0.0.1"], "metrics.bindHost=127.0.0.1 is the pod's own loopback"),
        (["metrics.bindHost=::1"], "metrics.bindHost=::1 is the pod's own loopback"),
        (["metrics.bindHost=localhost"], "metrics.bindHost=localhost is the pod's own loopback"),
        (["metrics.podMonitor.enabled=true", "hostNetwork=true"], "metrics.podMonitor.enabled needs"),
        (
            ["nri.runtime.patchConfig=true", "runtime=openshift"],
            "nri.runtime.patchConfig is not for OpenShift",
        ),
    ],
    ids=[
        "reversed",
        "reversed-later",
        "no-proof",
        "no-source",
        "loopback",
        "loopback-v6",
        "localhost",
        "podmonitor-hostnetwork",
        "patch-openshift",
    ],
)
def test_helm_refuses_what_the_daemon_would_refuse(values: list[str], message: str) -> None:
    """Values the schema lets through but the daemon (or kubelet's probes) would not: refused at install
    with the reason, instead of a crash loop (or a pod never ready) on every node."""
    args = ["template", "rel", str(CHART), *REQUIRED]
    for value in values:
        args += ["--set", value]
    result = helm(*args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_helm_still_renders_what_the_daemon_takes() -> None:
    for values in (
        ["devicePlugin.enabled=false", "trustedSources.podAnnotation=true"],
        ["hostNetwork=true", "metrics.bindHost=127.0.0.1"],  # ignored with hostNetwork
        ["metrics.bindHost=::"],
        ["sharedCpuset=0-0"],
    ):
        config_of(helm_template(*values))


@pytest.mark.parametrize(
    ("release", "extra", "name"),
    [
        ("mixed-cpu", [], "mixed-cpu"),
        ("mixed-cpu-nri-plugin", [], "mixed-cpu-nri-plugin"),
        ("pool-a", [], "pool-a-mixed-cpu-nri-plugin"),
        ("pool-a", ["fullnameOverride=shared-cpus"], "shared-cpus"),
    ],
)
def test_helm_object_names(release: str, extra: list[str], name: str) -> None:
    args = ["template", release, str(CHART), "--namespace", "nri-test", *REQUIRED]
    for value in extra:
        args += ["--set", value]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    docs = load_documents(result.stdout)
    assert one(docs, "DaemonSet")["metadata"]["name"] == name
    assert one(docs, "ConfigMap")["metadata"]["name"] == name


def test_helm_pod_monitor_scrapes_the_pods_metrics_port() -> None:
    docs = helm_template("metrics.podMonitor.enabled=true", "metrics.podMonitor.labels.release=prom")
    ds = check_daemonset(docs)
    monitor = one(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["metadata"]["namespace"] == ds["metadata"]["namespace"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    [port] = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert (endpoint["port"], endpoint["path"]) == (port["name"], "/metrics")
    assert not [d for d in helm_template() if d["kind"] == "PodMonitor"], "off by default"


def test_helm_dashboard_config_map_only_when_asked_for() -> None:
    """Off by default; on, a ConfigMap with the label Grafana's sidecar watches, holding the dashboard
    file of the chart byte for byte."""
    assert values()["dashboard"]["enabled"] is False
    assert not [d for d in helm_template() if d["metadata"]["name"].endswith("-dashboard")]
    docs = helm_template("dashboard.enabled=true", "dashboard.namespace=monitoring", "dashboard.folder=NRI")
    [board] = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rel-mixed-cpu-nri-plugin-dashboard"
    ]
    assert board["metadata"]["namespace"] == "monitoring"
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["metadata"]["annotations"] == {"grafana_folder": "NRI"}
    [(key, text)] = board["data"].items()
    assert key == "mixed-cpu-nri-plugin.json"
    assert text == (CHART / "dashboards" / key).read_text().rstrip("\n")
    assert json.loads(text)["uid"] == "mixed-cpu-nri-plugin"
    other = helm_template(
        "dashboard.enabled=true", "dashboard.label=my_dashboards", "dashboard.labelValue=yes"
    )
    [board] = [d for d in other if d["metadata"]["name"].endswith("-dashboard")]
    assert board["metadata"]["namespace"] == "nri-test"
    assert board["metadata"]["labels"]["my_dashboards"] == "yes"
    assert "grafana_dashboard" not in board["metadata"]["labels"]


def test_helm_prometheus_rule_only_when_asked_for_and_is_the_rules_file() -> None:
    """Off by default; on, a PrometheusRule whose spec is the plain rules file the chart ships
    (alerts/, which promtool checks and tests: tests/test_alert_rules.py), with the labels its
    Prometheus selects rules by."""
    assert values()["prometheusRule"]["enabled"] is False
    assert not [d for d in helm_template() if d["kind"] == "PrometheusRule"], "off by default"
    docs = helm_template(
        "prometheusRule.enabled=true",
        "prometheusRule.labels.release=kps",
        "prometheusRule.namespace=monitoring",
    )
    rule = one(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["metadata"]["labels"]["app.kubernetes.io/name"] == "mixed-cpu-nri-plugin"
    assert rule["spec"] == yaml.safe_load((CHART / "alerts" / "mixed-cpu-nri-plugin.rules.yaml").read_text())
    assert one(helm_template("prometheusRule.enabled=true"), "PrometheusRule")["metadata"]["namespace"] == (
        "nri-test"
    )


def test_helm_env_names_the_node_and_takes_extra_variables() -> None:
    docs = helm_template("extraEnv[0].name=HTTPS_PROXY", "extraEnv[0].value=http://proxy:3128")
    [container] = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    env = env_of(container)
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["HTTPS_PROXY"] == {"name": "HTTPS_PROXY", "value": "http://proxy:3128"}
    assert list(env) == ["NODE_NAME", "HTTPS_PROXY"]


@pytest.mark.parametrize(
    ("runtime", "config_dir"),
    [("containerd", posixpath.dirname(CONTAINERD_CONFIG)), ("cri-o", posixpath.dirname(CRIO_DROP_IN))],
)
def test_helm_patch_config_init_container_runs_enable_nri(runtime: str, config_dir: str) -> None:
    """nri.runtime.patchConfig: an init container of the same image runs ``enable-nri`` with the host's
    directories mounted where that command looks for them."""
    from nri_plugin.daemon.cli import _parser

    docs = helm_template("nri.runtime.patchConfig=true", f"runtime={runtime}")
    spec = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    [init] = spec["initContainers"]
    assert init["image"] == spec["containers"][0]["image"]
    args = _parser().parse_args(init["args"])
    assert (args.command, args.runtime) == ("enable-nri", runtime)
    assert init["securityContext"]["privileged"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in init["volumeMounts"]}
    host = args.host_root
    assert mounts[posixpath.join(host, config_dir)]["hostPath"]["path"] == "/" + config_dir
    assert mounts[posixpath.join(host, posixpath.dirname(NRI_SOCKET))]["name"] == "nri-sockets"
    bus_dir = posixpath.dirname(SYSTEM_BUS)
    bus_volume = mounts[posixpath.join(host, bus_dir.lstrip("/"))]
    assert bus_volume["hostPath"] == {"path": bus_dir, "type": "Directory"}
    # The pod must start before NRI is on, when the runtime has not made its socket directory yet.
    assert volumes["nri-sockets"]["hostPath"]["type"] == "DirectoryOrCreate"
    assert "initContainers" not in one(helm_template(), "DaemonSet")["spec"]["template"]["spec"]


def test_manifest_configs_point_at_the_example_with_every_key() -> None:
    """The config files the manifests carry say where every key is explained, and that place exists."""
    rendered = one(helm_template(), "ConfigMap")["data"]["config.toml"]
    texts = {
        "chart": rendered,
        **{str(p.relative_to(ROOT)): p.read_text() for p in KUSTOMIZE.rglob("config.toml")},
    }
    for name, text in texts.items():
        assert "examples/config.toml" in text, name
        assert 'README.md, "Every key' not in text, f"{name}: points at a README section that is gone"
    assert (ROOT / "examples" / "config.toml").is_file()


# -- the metrics port's NetworkPolicy (issue 13) ------------------------------------------------------

PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}
SCRAPER_SETS = (
    "metrics.networkPolicy.scrapers[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
    "metrics.networkPolicy.scrapers[0].podSelector.matchLabels.app\\.kubernetes\\.io/name=prometheus",
)


def test_helm_network_policy_admits_only_the_named_scrapers() -> None:
    for extra in ([], ["metrics.port=9100"], ["metrics.podMonitor.enabled=true"]):
        docs = helm_template(*SCRAPER_SETS, *extra)
        check_network_policy(docs, check_daemonset(docs), [PROMETHEUS])
    docs = helm_template("metrics.networkPolicy.scrapers[0].ipBlock.cidr=10.0.0.0/24")
    check_network_policy(docs, one(docs, "DaemonSet"), [{"ipBlock": {"cidr": "10.0.0.0/24"}}])


def test_helm_network_policy_admits_nobody_when_nothing_scrapes() -> None:
    """No annotations and no PodMonitor: nothing scrapes, so no pod may connect (kubelet's probes
    come from the node)."""
    docs = helm_template("metrics.scrapeAnnotations=false")
    ds = check_daemonset(docs)
    assert "prometheus.io/scrape" not in ds["spec"]["template"]["metadata"]["annotations"]
    check_network_policy(docs, ds, [])


@pytest.mark.parametrize(
    "values",
    [
        [],  # the default: the prometheus.io annotations, for a scraper the chart cannot name
        ["metrics.podMonitor.enabled=true", "metrics.scrapeAnnotations=false"],
        ["metrics.networkPolicy.enabled=false", "metrics.scrapeAnnotations=false"],
        ["metrics.networkPolicy.enabled=false", *SCRAPER_SETS],
        ["hostNetwork=true", "metrics.scrapeAnnotations=false"],  # a NetworkPolicy never applies
        ["metrics.enabled=false", "metrics.scrapeAnnotations=false"],
    ],
    ids=["default", "podmonitor", "off", "off-with-scrapers", "host-network", "metrics-off"],
)
def test_helm_no_network_policy_where_it_would_cut_a_scraper_off_or_guard_nothing(values: list[str]) -> None:
    assert not network_policies(helm_template(*values))


@pytest.mark.parametrize(
    "bad",
    [
        "metrics.networkPolicy.scrapers[0].service=prometheus",
        "metrics.networkPolicy.scrapers[0].ipBlock.cidr=10.0.0.0",
        "metrics.networkPolicy.scrapers[0].podSelector.matchLabels=x",
        "metrics.networkPolicy.enabled=yes",
    ],
)
def test_helm_schema_rejects_bad_network_policy_values(bad: str) -> None:
    result = helm("template", "rel", str(CHART), *REQUIRED, "--set", bad)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr


# -- the DRA front door (issue 23) -------------------------------------------------------------------

# Kinds without a schema in kubernetes-validate: CRDs (Prometheus Operator, OpenShift).
_NO_SCHEMA = {"PodMonitor", "PrometheusRule", "SecurityContextConstraints"}


def validate_manifests(docs: list[Doc]) -> None:
    """Every rendered object against the Kubernetes OpenAPI schema of the newest version
    kubernetes-validate knows (strict: unknown fields refused)."""
    version = kubernetes_validate.latest_version()
    for doc in docs:
        if doc["kind"] in _NO_SCHEMA:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(part) for part in exc.path)
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {path}: {exc.message}")


DRA_KINDS = {
    "DeviceClass",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


@pytest.mark.parametrize(
    "sets",
    [
        [],
        ["dra.enabled=true"],
        ["dra.enabled=true", "devicePlugin.enabled=false", "runtime=openshift", "hostNetwork=true"],
        [
            "metrics.podMonitor.enabled=true",
            "dashboard.enabled=true",
            "prometheusRule.enabled=true",
            "nri.runtime.patchConfig=true",
        ],
        ["metrics.networkPolicy.scrapers[0].podSelector.matchLabels.app=prometheus"],
    ],
    ids=["default", "dra", "dra-openshift", "extras", "network-policy"],
)
def test_helm_every_rendered_manifest_validates(sets: list[str]) -> None:
    validate_manifests(helm_template(*sets))


def test_helm_dra_off_renders_nothing_of_it() -> None:
    docs = helm_template()
    assert not [d for d in docs if d["kind"] in DRA_KINDS]
    assert not config_of(docs).dra.enabled
    assert one(docs, "ServiceAccount")["automountServiceAccountToken"] is False


def test_helm_dra_on_renders_the_device_class_rbac_and_mounts() -> None:
    docs = helm_template("dra.enabled=true")
    ds = check_daemonset(docs)
    validate_manifests(docs)
    config = config_of(docs)
    assert config.dra.enabled
    assert config.dra.driver_name == DRIVER == values()["dra"]["driverName"]
    assert config.trust_device_plugin_marker
    assert one(docs, "ServiceAccount")["automountServiceAccountToken"] is True

    # The DeviceClass is the one nri_plugin.dra.slices describes for the driver.
    device_class = one(docs, "DeviceClass")
    expected = dra_slices.device_class(DRIVER)
    assert {k: v for k, v in device_class.items() if k != "metadata"} == {
        k: v for k, v in expected.items() if k != "metadata"
    }
    assert device_class["metadata"]["name"] == expected["metadata"]["name"] == DRIVER
    assert device_class["spec"]["extendedResourceName"] == "workload.openshift.io/enable-shared-cpus"
    assert "namespace" not in device_class["metadata"], "cluster-scoped"

    # The ClusterRole grants what the publisher and the claim source call, bound to the pod's account.
    role = one(docs, "ClusterRole")
    grants = {
        (rule["apiGroups"][0], resource): set(rule["verbs"])
        for rule in role["rules"]
        for resource in rule["resources"]
    }
    assert grants == {
        ("resource.k8s.io", "resourceslices"): {
            "get",
            "list",
            "watch",
            "create",
            "update",
            "patch",
            "delete",
        },
        ("resource.k8s.io", "resourceclaims"): {"get"},
        ("", "nodes"): {"get"},
    }
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": ds["spec"]["template"]["spec"]["serviceAccountName"],
            "namespace": ds["metadata"]["namespace"],
        }
    ]


def test_helm_dra_device_class_options() -> None:
    docs = helm_template("dra.enabled=true", "dra.deviceClass.extendedResourceName=")
    device_class = one(docs, "DeviceClass")
    assert "extendedResourceName" not in device_class["spec"]
    assert device_class == {**device_class, **{"spec": dra_slices.device_class(DRIVER, "")["spec"]}}
    validate_manifests(docs)
    docs = helm_template("dra.enabled=true", "dra.deviceClass.create=false")
    assert not [d for d in docs if d["kind"] == "DeviceClass"]
    assert {"ClusterRole", "ClusterRoleBinding"} <= {d["kind"] for d in docs}


def test_helm_dra_driver_name_reaches_every_place() -> None:
    driver = "cpus.example.com"
    docs = helm_template("dra.enabled=true", f"dra.driverName={driver}")
    check_daemonset(docs)  # the plugin's socket directory follows the driver name
    validate_manifests(docs)
    assert config_of(docs).dra.driver_name == driver
    device_class = one(docs, "DeviceClass")
    assert device_class["metadata"]["name"] == driver
    assert device_class["spec"]["selectors"] == [{"cel": {"expression": f'device.driver == "{driver}"'}}]


def test_helm_dra_alone_proves_requests() -> None:
    docs = helm_template("dra.enabled=true", "devicePlugin.enabled=false")
    check_daemonset(docs)
    config = config_of(docs)
    assert config.dra.enabled
    assert not config.device_plugin.enabled


@pytest.mark.parametrize(
    "bad",
    [
        "dra.driverName=Shared_CPUs",
        f"dra.driverName={'a' * 64}",
        "dra.deviceClass.extendedResourceName=no-domain",
        "dra.unknown=1",
    ],
)
def test_helm_schema_rejects_bad_dra_values(bad: str) -> None:
    result = helm("template", "rel", str(CHART), *REQUIRED, "--set", "dra.enabled=true", "--set", bad)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr


def test_helm_refuses_dra_without_the_marker_trusted() -> None:
    result = helm(
        "template",
        "rel",
        str(CHART),
        *REQUIRED,
        "--set",
        "dra.enabled=true",
        "--set",
        "trustedSources.devicePluginMarker=false",
        "--set",
        "trustedSources.podAnnotation=true",
    )
    assert result.returncode != 0
    assert "dra.enabled=true needs trustedSources.devicePluginMarker=true" in result.stderr, result.stderr


def test_validate_manifests_catches_a_broken_object() -> None:
    """The check above is not vacuous: a misspelled field in a rendered object fails it."""
    docs = helm_template("dra.enabled=true")
    broken = [dict(doc) for doc in docs]
    for doc in broken:
        if doc["kind"] == "DeviceClass":
            doc["spec"] = {**doc["spec"], "extendedResource": doc["spec"]["extendedResourceName"]}
    with pytest.raises(
        pytest.fail.Exception, match=re.escape(f"DeviceClass {DRIVER}: spec: Additional properties")
    ):
        validate_manifests(broken)


# -- the DRA admission policy: each node's daemon writes only its own node's ResourceSlices ----------

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


def admit(policy: Doc, operation: str, user: Doc, new: Doc | None, old: Doc | None) -> str | None:
    """Evaluate the ValidatingAdmissionPolicy's CEL on one ResourceSlice request as kube-apiserver does:
    unmatched (a matchCondition false) is admitted; else the variables in order, then every validation,
    an error counting as a refusal (failurePolicy Fail). None when admitted, else the refusal's message."""
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    env = celpy.Environment()

    def evaluate(expression: str, activation: dict[str, Any]) -> Any:
        return env.program(env.compile(expression)).evaluate(activation)

    activation: dict[str, Any] = {
        "request": json_to_cel({"operation": operation, "userInfo": user}),
        "object": json_to_cel(new),
        "oldObject": json_to_cel(old),
    }
    if not all(evaluate(c["expression"], activation) for c in spec["matchConditions"]):
        return None
    variables: dict[str, Any] = {}
    for variable in spec.get("variables", []):
        activation["variables"] = json_to_cel(variables)
        variables[variable["name"]] = evaluate(variable["expression"], activation)
    activation["variables"] = json_to_cel(variables)
    for validation in spec["validations"]:
        try:
            passed = evaluate(validation["expression"], activation)
        except CELEvalError as exc:
            return f"error: {exc}"
        if not passed:
            if "messageExpression" in validation:
                return str(evaluate(validation["messageExpression"], activation))
            return str(validation["message"])
    return None


def resource_slice(node: str | None, driver: str = DRIVER) -> Doc:
    """A ResourceSlice as the publisher writes it (nri_plugin.dra.slices), on `node`; None: allNodes."""
    [obj] = dra_slices.resource_slices(
        node_name=node or "elsewhere", node_uid="0" * 8, driver=driver, device_count=2, generation=1
    )
    if node is None:
        del obj["spec"]["nodeName"]
        obj["spec"]["allNodes"] = True
    return obj


def test_dra_admission_policy_keeps_each_daemon_to_its_own_node() -> None:
    docs = helm_template("dra.enabled=true")
    validate_manifests(docs)
    policy = one(docs, "ValidatingAdmissionPolicy")
    binding = one(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule == {
        "apiGroups": ["resource.k8s.io"],
        "apiVersions": ["*"],
        "operations": ["CREATE", "UPDATE", "DELETE"],
        "resources": ["resourceslices"],
    }
    # The user it matches is the daemon's service account, as bound by the ClusterRoleBinding.
    [subject] = one(docs, "ClusterRoleBinding")["subjects"]
    username = f"system:serviceaccount:{subject['namespace']}:{subject['name']}"
    daemon = {"username": username, "extra": {NODE_NAME_EXTRA: ["node-a"]}}

    mine, theirs = resource_slice("node-a"), resource_slice("node-b")
    # Its own node's slices: created, updated (server-side apply), deleted.
    assert admit(policy, "CREATE", daemon, mine, None) is None
    assert admit(policy, "UPDATE", daemon, mine, mine) is None
    assert admit(policy, "DELETE", daemon, None, mine) is None
    # Another node's: refused, whichever way, with the node and the driver named.
    refusal = admit(policy, "CREATE", daemon, theirs, None)
    assert refusal is not None
    assert "node-a" in refusal
    assert DRIVER in refusal
    assert admit(policy, "DELETE", daemon, None, theirs) is not None, "a delete is checked on the old object"
    assert admit(policy, "UPDATE", daemon, mine, theirs) is not None, "no moving a slice to our node"
    assert admit(policy, "UPDATE", daemon, theirs, mine) is not None, "nor away from it"
    # Not for every node (allNodes), nor another driver's slice on our node.
    assert admit(policy, "CREATE", daemon, resource_slice(None), None) is not None
    assert admit(policy, "CREATE", daemon, resource_slice("node-a", "gpu.example.com"), None) is not None
    # A token that names no node (not pod-bound, or an API server without ServiceAccountTokenPodNodeInfo)
    # may write nothing.
    extras: list[dict[str, list[str]]] = [{}, {NODE_NAME_EXTRA: []}, {NODE_NAME_EXTRA: ["node-a", "node-b"]}]
    for extra in extras:
        refusal = admit(policy, "CREATE", {"username": username, "extra": extra}, mine, None)
        assert refusal is not None
        assert NODE_NAME_EXTRA in refusal
    assert admit(policy, "CREATE", {"username": username}, mine, None) is not None
    # Anyone else (kubelet, an admin, another driver) is not this policy's business.
    for user in ({"username": "system:node:node-b"}, {"username": "system:serviceaccount:other:sa"}):
        assert admit(policy, "CREATE", user, theirs, None) is None
        assert admit(policy, "DELETE", user, None, theirs) is None


def test_dra_admission_policy_follows_the_release() -> None:
    docs = helm_template(
        "dra.enabled=true",
        "serviceAccount.name=nri-daemon",
        "dra.driverName=cpus.example.com",
    )
    validate_manifests(docs)
    policy = one(docs, "ValidatingAdmissionPolicy")
    daemon = {"username": "system:serviceaccount:nri-test:nri-daemon", "extra": {NODE_NAME_EXTRA: ["n1"]}}
    assert admit(policy, "CREATE", daemon, resource_slice("n1", "cpus.example.com"), None) is None
    assert admit(policy, "CREATE", daemon, resource_slice("n2", "cpus.example.com"), None) is not None
    assert admit(policy, "CREATE", daemon, resource_slice("n1"), None) is not None
    # The release's default account name is no longer the daemon's: not matched.
    [default_name] = {
        d["metadata"]["name"] for d in helm_template("dra.enabled=true") if d["kind"] == "ServiceAccount"
    }
    other = {"username": f"system:serviceaccount:nri-test:{default_name}", "extra": {NODE_NAME_EXTRA: ["n1"]}}
    assert admit(policy, "CREATE", other, resource_slice("n2", "cpus.example.com"), None) is None


def test_dra_admission_policy_values() -> None:
    kinds = {d["kind"] for d in helm_template("dra.enabled=true", "dra.admissionPolicy.create=false")}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    assert {"DeviceClass", "ClusterRole", "ClusterRoleBinding"} <= kinds
    kinds = {d["kind"] for d in helm_template("dra.admissionPolicy.create=true")}
    assert not kinds & DRA_KINDS, "nothing of DRA while dra.enabled is false"
    assert values()["dra"]["admissionPolicy"]["create"] is True


# -- the DRA component of the kustomize manifests ------------------------------------------------------

DRA_COMPONENT = KUSTOMIZE / "components" / "dra"


def kustomize_with_dra(overlay: str, tmp_path: Path) -> list[Doc]:
    """An overlay with the DRA component added, as an operator adds it."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: cannot render the kustomize overlays")
    base = os.path.relpath(KUSTOMIZE / "overlays" / overlay, tmp_path)  # kustomize: relative only
    component = os.path.relpath(DRA_COMPONENT, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {base}\ncomponents:\n  - {component}\n"
    )
    result = subprocess.run(
        [KUBECTL, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=GUARD, check=False
    )
    assert result.returncode == 0, result.stderr
    return load_documents(result.stdout)


def test_kustomize_dra_config_is_the_base_config_plus_dra() -> None:
    base = parse_config(tomllib.loads((KUSTOMIZE / "base" / "config.toml").read_text()))
    with_dra = parse_config(tomllib.loads((DRA_COMPONENT / "config.toml").read_text()))
    assert not base.dra.enabled
    assert with_dra.dra.enabled
    assert with_dra.dra.driver_name == DRIVER
    assert not with_dra.dra.node_name, "the node name comes from NODE_NAME"
    assert with_dra == dataclasses.replace(base, dra=with_dra.dra), "only [dra] differs from the base"


@pytest.mark.parametrize("overlay", ["containerd", "cri-o"])
def test_kustomize_dra_component_on_an_overlay(overlay: str, tmp_path: Path) -> None:
    docs = kustomize_with_dra(overlay, tmp_path)
    ds = check_daemonset(docs)  # with [dra] on: the kubelet directories, NODE_NAME and the token
    validate_manifests(docs)
    assert config_of(docs).dra.enabled
    assert one(docs, "ServiceAccount")["automountServiceAccountToken"] is True
    assert {d["kind"] for d in docs} >= DRA_KINDS
    # The binding and the policy name the pod's own service account.
    account = ds["spec"]["template"]["spec"]["serviceAccountName"]
    namespace = ds["metadata"]["namespace"]
    assert one(docs, "ServiceAccount")["metadata"]["name"] == account
    assert one(docs, "ClusterRoleBinding")["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": namespace}
    ]
    policy = one(docs, "ValidatingAdmissionPolicy")
    daemon = {"username": f"system:serviceaccount:{namespace}:{account}", "extra": {NODE_NAME_EXTRA: ["n1"]}}
    assert admit(policy, "CREATE", daemon, resource_slice("n1"), None) is None
    assert admit(policy, "CREATE", daemon, resource_slice("n2"), None) is not None
    assert admit(policy, "DELETE", daemon, None, resource_slice("n2")) is not None
    # The overlay's own settings stay (the cri-o overlay's SELinux type).
    security = ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert ("seLinuxOptions" in security) == (overlay == "cri-o")


def without_labels(doc: Doc) -> Doc:
    return {**doc, "metadata": {k: v for k, v in doc["metadata"].items() if k != "labels"}}


def test_kustomize_dra_component_matches_the_chart(tmp_path: Path) -> None:
    """The component renders what the chart renders with dra.enabled=true, for the same names."""
    kustomized = kustomize_with_dra("containerd", tmp_path)
    namespace = one(kustomized, "Namespace")["metadata"]["name"]
    result = helm(
        "template",
        "rel",
        str(CHART),
        "--namespace",
        namespace,
        *REQUIRED,
        "--set",
        "dra.enabled=true",
        "--set",
        f"fullnameOverride={one(kustomized, 'DaemonSet')['metadata']['name']}",
    )
    assert result.returncode == 0, result.stderr
    charted = load_documents(result.stdout)
    for kind in DRA_KINDS:
        assert without_labels(one(kustomized, kind)) == without_labels(one(charted, kind)), kind
    assert config_of(kustomized).dra == config_of(charted).dra
    assert one(kustomized, "ServiceAccount")["automountServiceAccountToken"] is True
    assert one(charted, "ServiceAccount")["automountServiceAccountToken"] is True

    def dra_mounts(docs: list[Doc]) -> tuple[dict[str, Doc], dict[str, Doc]]:
        spec = one(docs, "DaemonSet")["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is True
        config = config_of(docs).dra
        paths = {str(config.registry_dir), f"{config.plugins_dir}/{config.driver_name}", str(config.cdi_dir)}
        volumes = {v["name"]: v for v in spec["volumes"] if v.get("hostPath", {}).get("path") in paths}
        mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"] if m["name"] in volumes}
        assert len(volumes) == len(mounts) == 3
        return volumes, mounts

    assert dra_mounts(kustomized) == dra_mounts(charted)


# -- the image -----------------------------------------------------------------------------------------


def dockerfile_stages() -> tuple[dict[str, str], list[tuple[str, list[tuple[str, str]]]]]:
    """(global ARG defaults, [(FROM image after ARG expansion, [(instruction, arguments)])])."""
    lines: list[str] = []
    pending = ""
    for raw in (PACKAGING / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        lines.append(pending + raw)
        pending = ""
    args: dict[str, str] = {}
    stages: list[tuple[str, list[tuple[str, str]]]] = []
    for line in lines:
        instruction, _, rest = line.strip().partition(" ")
        instruction = instruction.upper()
        if instruction == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif instruction == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest)
            stages.append((image, []))
        else:
            assert stages, f"{instruction} before the first FROM"
            stages[-1][1].append((instruction, rest))
    return args, stages


def test_dockerfile_builds_a_venv_and_runs_it_without_a_shell() -> None:
    _, stages = dockerfile_stages()
    assert len(stages) == 2
    (build_image, build), (final_image, final) = stages
    assert build_image.split()[-2:] == ["AS", "build"]
    assert build_image.startswith("debian:trixie")  # Debian 13, as the final image
    assert final_image == "gcr.io/distroless/python3-debian13"
    # The venv is made by Debian 13's /usr/bin/python3.13, the interpreter the distroless image runs.
    runs = " ".join(rest for instruction, rest in build if instruction == "RUN")
    assert f"/usr/bin/python3.13 -m venv {HOST_VENV}" in runs
    # The final stage only copies: it has no shell to RUN anything with.
    assert {instruction for instruction, _ in final} <= {"COPY", "ENV", "ENTRYPOINT", "CMD", "LABEL", "USER"}
    copies = [rest for instruction, rest in final if instruction == "COPY"]
    assert copies == ["--from=build /stdlib-pyc/ /", f"--from=build {HOST_VENV} {HOST_VENV}"]
    entrypoint = json.loads(next(rest for instruction, rest in final if instruction == "ENTRYPOINT"))
    assert entrypoint == [f"{HOST_VENV}/bin/python", f"{HOST_VENV}/bin/{CONSOLE_SCRIPT}"]
    cmd = json.loads(next(rest for instruction, rest in final if instruction == "CMD"))
    assert cmd == ["run", "--config", DEFAULT_CONFIG_PATH]
    # `kubectl exec ds/... -- mixed-cpu-nri-plugin status` runs the console script by name, with no shell.
    envs = [rest for instruction, rest in final if instruction == "ENV"]
    assert any(env.startswith(f"PATH={HOST_VENV}/bin:") for env in envs), envs
    assert ("USER", "nonroot") not in final


IMAGE_LOCK = PACKAGING / "image.lock"


def test_dockerfile_installs_only_locked_wheels_with_no_index() -> None:
    """The build fetches nothing: the lock and the wheelhouse are all it copies, pip never reaches an
    index, and every dependency's wheel is checked against its pinned sha256."""
    _, stages = dockerfile_stages()
    build = stages[0][1]
    copies = [rest.split() for instruction, rest in build if instruction == "COPY"]
    assert [source for *sources, _ in copies for source in sources] == [
        "packaging/image.lock",
        "packaging/wheelhouse",
    ]
    pips = [
        command.strip()
        for instruction, rest in build
        if instruction == "RUN"
        for command in rest.split("&&")
        if " install " in command and "/bin/pip" in command
    ]
    assert len(pips) == 2, pips
    assert all("--no-index" in pip for pip in pips)
    locked, project = pips
    assert "--require-hashes" in locked
    assert "--no-deps" in locked
    assert "-r /tmp/image.lock" in locked
    # The project's wheel with the extra that makes DRA work in the image.
    assert re.search(r"mixed_cpu_nri_plugin-\*\.whl\)\[dra\]", project), project
    ignore = (PACKAGING / "Dockerfile.dockerignore").read_text().splitlines()
    assert [line for line in ignore if line and not line.startswith("#")] == [
        "*",
        "!packaging/image.lock",
        "!packaging/wheelhouse/",
    ]


def image_lock_pins() -> dict[str, tuple[str, list[str]]]:
    """packaging/image.lock: {name: (version, [sha256, ...])}."""
    pins: dict[str, tuple[str, list[str]]] = {}
    name = ""
    for line in IMAGE_LOCK.read_text().splitlines():
        entry = line.strip().removesuffix("\\").strip()
        if not entry or entry.startswith("#"):
            continue
        if entry.startswith("--hash=sha256:"):
            pins[name][1].append(entry.removeprefix("--hash=sha256:"))
        else:
            name, version = entry.split("==")
            pins[name] = (version, [])
    return pins


def test_image_lock_pins_every_requirement_of_the_project_with_hashes() -> None:
    """A dependency added to pyproject, or a bound moved past the pin, fails here, not in the image
    build: `packaging/build-image.sh lock` makes the lock again."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = image_lock_pins()
    assert pins
    for name, (version, digests) in pins.items():
        assert name == canonicalize_name(name), name
        assert version, name
        assert digests, name
        assert all(re.fullmatch(r"[0-9a-f]{64}", d) for d in digests), name
    # The image's Python, on Linux, with the extras the image installs.
    image_python = {"python_version": "3.13", "python_full_version": "3.13.5", "sys_platform": "linux"}
    wanted = list(PYPROJECT["project"]["dependencies"])
    wanted += PYPROJECT["project"].get("optional-dependencies", {}).get("dra", [])
    for text in wanted:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({**image_python, "extra": "dra"}):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not in packaging/image.lock: run packaging/build-image.sh lock"
        assert requirement.specifier.contains(pins[name][0], prereleases=True), (
            f"{name}=={pins[name][0]} in packaging/image.lock is not {requirement.specifier}:"
            " run packaging/build-image.sh lock"
        )


def fake_wheel(folder: Path, name: str, version: str, tag: str) -> Path:
    """A minimal wheel pip accepts: its metadata and nothing else."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-{tag}.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        archive.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def test_image_lock_tool_writes_a_lock_pip_enforces(tmp_path: Path) -> None:
    """packaging/image_lock.py's lock, read by pip in hash-checking mode as the image build reads it:
    the locked wheels pass, a wheel whose bytes changed is refused."""
    x86 = [fake_wheel(tmp_path / "x86_64", "alpha_pkg", "1.0", "py3-none-any")]
    x86.append(fake_wheel(tmp_path / "x86_64", "beta", "2.1", "py3-none-any"))
    fake_wheel(tmp_path / "aarch64", "alpha_pkg", "1.0", "py3-none-any")
    other = fake_wheel(tmp_path / "aarch64", "beta", "2.1", "py3-none-any")
    with zipfile.ZipFile(other, "a") as archive:  # another build of it: other bytes, other sha256
        archive.writestr("beta.py", "")
    tool = [sys.executable, str(PACKAGING / "image_lock.py")]
    pins = subprocess.run(
        [*tool, "pins", str(tmp_path / "x86_64")], capture_output=True, text=True, check=True
    )
    assert pins.stdout.split() == ["alpha-pkg==1.0", "beta==2.1"]
    lock = tmp_path / "image.lock"
    subprocess.run(
        [*tool, "write", str(lock), str(tmp_path / "x86_64"), str(tmp_path / "aarch64")], check=True
    )
    text = lock.read_text()
    assert text.count("--hash=sha256:") == 3  # alpha's wheels are the same bytes on both
    assert "beta==2.1 \\\n" in text

    def pip_download(find_links: Path) -> subprocess.CompletedProcess[str]:
        """Offline, with no pip config of this machine's, as the Dockerfile's first pip install."""
        pip = [sys.executable, "-m", "pip", "--isolated", "download", "-q", "--no-index", "--no-deps"]
        where = ["--find-links", str(find_links), "-d", str(tmp_path / f"got-{find_links.name}")]
        return subprocess.run(
            [*pip, *where, "--require-hashes", "-r", str(lock)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    assert pip_download(tmp_path / "x86_64").returncode == 0
    tampered = tmp_path / "tampered"
    shutil.copytree(tmp_path / "x86_64", tampered)
    with zipfile.ZipFile(tampered / x86[1].name, "a") as archive:
        archive.writestr("beta.py", "print('not what was locked')")
    refused = pip_download(tampered)
    assert refused.returncode != 0
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in refused.stderr, refused.stderr


# -- runtime drop-ins --------------------------------------------------------------------------------

NRI_TABLE = "io.containerd.nri.v1.nri"
CONTAINERD_KEYS = {
    "disable",
    "disable_connections",
    "socket_path",
    "plugin_path",
    "plugin_config_path",
    "plugin_registration_timeout",
    "plugin_request_timeout",
}
CRIO_NRI_KEYS = {
    "enable_nri",
    "nri_listen",
    "nri_disable_connections",
    "nri_plugin_dir",
    "nri_plugin_config_dir",
    "nri_plugin_registration_timeout",
    "nri_plugin_request_timeout",
}


def walk(doc: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in doc.items():
        if isinstance(value, Mapping):
            yield from walk(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def uncommented(path: Path) -> dict[str, Any]:
    """The drop-in with its commented-out optional block switched on: that block must parse too."""
    lines = []
    for line in path.read_text().splitlines():
        if (
            line.startswith("# [")
            or (line.startswith("#   ") and "=" in line and "'" not in line)
            or (line.startswith("# nri_"))
        ):
            line = line[2:]
        lines.append(line)
    return tomllib.loads("\n".join(lines))


@pytest.mark.parametrize(("name", "version"), [("config-1.7.toml", 2), ("config-2.x.toml", 3)])
def test_containerd_dropin(name: str, version: int) -> None:
    path = RUNTIME / "containerd" / name
    doc = tomllib.loads(path.read_text())
    assert doc["version"] == version
    table = doc["plugins"][NRI_TABLE]
    assert set(table) == CONTAINERD_KEYS
    assert table["disable"] is False
    assert table["disable_connections"] is False
    assert table["socket_path"] == DEFAULT_NRI_SOCKET
    assert table["plugin_path"] == "/opt/nri/plugins"
    assert table["plugin_config_path"] == "/etc/nri/conf.d"
    assert table["plugin_registration_timeout"] == "5s"
    assert table["plugin_request_timeout"] == "2s"
    # The timeouts are read in that table only: nowhere else.
    for key, _ in walk(doc):
        if key.endswith("_timeout"):
            assert key.startswith(f"plugins.{NRI_TABLE}."), key
    if version == 3:
        validator = uncommented(path)["plugins"][NRI_TABLE]["default_validator"]
        assert validator == {
            "enable": True,
            "required_plugins": [],
            "tolerate_missing_plugins_annotation": TOLERATION_KEY,
        }


def test_crio_dropin() -> None:
    path = RUNTIME / "cri-o" / "10-nri.conf"
    doc = tomllib.loads(path.read_text())
    assert set(doc) == {"crio"}
    assert set(doc["crio"]) == {"nri"}
    table = doc["crio"]["nri"]
    assert set(table) == CRIO_NRI_KEYS
    assert table["enable_nri"] is True
    assert table["nri_disable_connections"] is False
    assert table["nri_listen"] == DEFAULT_NRI_SOCKET
    validator = uncommented(path)["crio"]["nri"]["default_validator"]
    assert validator == {
        "nri_enable_default_validator": True,
        "nri_validator_required_plugins": [],
        "nri_validator_tolerate_missing_plugins_annotation": TOLERATION_KEY,
    }


def test_openshift_crio_dropin_and_its_machineconfig_agree() -> None:
    dropin = RUNTIME / "openshift" / "99-mixed-cpu-nri.conf"
    doc = tomllib.loads(dropin.read_text())
    assert doc["crio"]["nri"] == {"enable_nri": True}
    [workload] = doc["crio"]["runtime"]["workloads"].values()
    assert workload["activation_annotation"]
    assert workload["allowed_annotations"] == ["cpu-shared.crio.io"]
    # CRI-O's own shared-CPU feature stays off, or shared CPUs would be applied twice.
    assert "shared_cpuset" not in doc["crio"]["runtime"]

    [machine_config] = load_documents((RUNTIME / "openshift" / "machineconfig-crio.yaml").read_text())
    assert machine_config["kind"] == "MachineConfig"
    [file] = machine_config["spec"]["config"]["storage"]["files"]
    assert file["path"] == f"/etc/crio/crio.conf.d/{dropin.name}"
    assert file["mode"] == 0o644
    header, _, data = file["contents"]["source"].partition(",")
    assert header.startswith("data:")
    assert not header.endswith(";base64")
    assert urllib.parse.unquote(data) == dropin.read_text()


# -- systemd ------------------------------------------------------------------------------------------


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keep the keys' case
    parser.read_string(UNIT.read_text())
    return parser


def test_unit_runs_the_console_script() -> None:
    service = unit()["Service"]
    command = shlex.split(service["ExecStart"])
    assert command == [f"{HOST_VENV}/bin/{CONSOLE_SCRIPT}", "run", "--config", DEFAULT_CONFIG_PATH]
    assert service["Restart"] == "always"
    assert set(unit()["Unit"]["After"].split()) >= {"containerd.service", "crio.service"}
    assert unit()["Install"]["WantedBy"] == "multi-user.target"
    # The state dir is systemd's StateDirectory (under /var/lib), writable despite ProtectSystem.
    assert service["StateDirectory"] == posixpath.relpath(DEFAULT_STATE_DIR, "/var/lib")
    assert service["ProtectSystem"] == "strict"
    assert str(DEFAULT_PLUGIN_DIR) in service["ReadWritePaths"].split()
    # Either of these would make /sys/fs/cgroup read-only; the plugin writes there.
    for key in ("ProtectControlGroups", "ProtectKernelTunables"):
        assert service.get(key, "no") == "no", key
    assert service["CapabilityBoundingSet"] == ""


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_unit_passes_systemd_analyze(tmp_path: Path) -> None:
    # verify also checks that ExecStart exists; it does not on a test machine, so point it elsewhere.
    text = UNIT.read_text()
    assert text.count(f"ExecStart={HOST_VENV}/bin/{CONSOLE_SCRIPT}") == 1
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(f"ExecStart={HOST_VENV}/bin/{CONSOLE_SCRIPT}", "ExecStart=/bin/true"))
    assert SYSTEMD_ANALYZE is not None
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert not result.stderr.strip(), "systemd-analyze warned about the unit"
    result = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=true", str(copy)],
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )
    if result.returncode != 0 and "--offline" in result.stderr:
        return  # systemd older than 250
    [level] = re.findall(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert float(level) < 4.0, result.stdout


# -- runtime-launched mode ------------------------------------------------------------------------------


def wrapper_defaults() -> dict[str, str]:
    return dict(re.findall(r'^\w+="\$\{(\w+):-([^}]+)\}"$', (LAUNCHED / "10-mixed-cpu").read_text(), re.M))


def test_launched_files_match_the_daemon() -> None:
    wrapper = LAUNCHED / "10-mixed-cpu"
    assert os.access(wrapper, os.X_OK), "the runtime starts only executable files"
    subprocess.run(["sh", "-n", str(wrapper)], check=True, timeout=GUARD)
    index, _, name = wrapper.name.partition("-")
    default = parse_config({"shared_cpuset": "0"})
    assert (index, name) == (default.plugin_index, default.plugin_name)
    defaults = wrapper_defaults()
    assert defaults["MIXED_CPU_NRI_PLUGIN"] == shlex.split(unit()["Service"]["ExecStart"])[0]
    assert defaults["MIXED_CPU_NRI_CONFIG"] == DEFAULT_CONFIG_PATH
    conf = LAUNCHED / f"{wrapper.name}.conf"
    assert tomllib.loads(conf.read_text()) == {}


@pytest.mark.asyncio
async def test_the_runtime_can_launch_the_wrapper(tmp_path: Path) -> None:
    """As containerd and CRI-O start a pre-installed plugin: no arguments, a socketpair end as fd 3, and
    only the NRI_PLUGIN_* variables (plus, here, the wrapper's three test overrides)."""
    script = Path(sys.executable).parent / CONSOLE_SCRIPT
    if not script.exists():
        pytest.skip(f"{script} is not installed (pip install -e .)")
    plugin_dir = Path("/tmp") / f"dp-{os.getpid()}-launch"
    plugin_dir.mkdir()
    config = write_daemon_config(tmp_path, plugin_dir, metrics_address="")
    log = tmp_path / "plugin.log"
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = {
        "NRI_PLUGIN_NAME": "mixed-cpu",
        "NRI_PLUGIN_IDX": "10",
        "NRI_PLUGIN_SOCKET": "3",
        "MIXED_CPU_NRI_PLUGIN": str(script),
        "MIXED_CPU_NRI_CONFIG": str(config),
        "MIXED_CPU_NRI_LOG": str(log),
    }
    # The socket arrives as fd 3, as with Go's exec.Cmd ExtraFiles; the wrapper gets no arguments.
    trampoline = "import os, sys; os.dup2(int(sys.argv[1]), 3); os.execv(sys.argv[2], sys.argv[2:])"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        trampoline,
        str(theirs.fileno()),
        str(LAUNCHED / "10-mixed-cpu"),
        env=env,
        pass_fds=(theirs.fileno(),),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    theirs.close()
    sim = RuntimeSimulator(tmp_path / "unused.sock")
    try:
        await sim.adopt(ours)
        waiting = asyncio.ensure_future(sim.wait_for_plugins(1, GUARD))
        exited = asyncio.ensure_future(proc.wait())
        await asyncio.wait([waiting, exited], return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            waiting.cancel()
            log_text = log.read_text() if log.exists() else "(no log)"
            log_text += (await proc.stderr.read()).decode() if proc.stderr else ""
            pytest.fail(f"the wrapper exited with {proc.returncode}: {log_text}")
        exited.cancel()
        [plugin] = waiting.result()
        assert plugin.full_name == "10-mixed-cpu"
        await sim.close()  # the runtime goes away: a launched plugin does not reconnect, it exits
        _, stderr = await asyncio.wait_for(proc.communicate(), GUARD)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        shutil.rmtree(plugin_dir, ignore_errors=True)
    assert stderr == b"", "the runtime discards the plugin's output: everything goes to the log file"
    text = log.read_text()
    assert "registered with the runtime" in text
    assert "Traceback" not in text
    # The log names the connection the runtime handed over, and why the plugin ended (issue 15).
    [starting] = [json.loads(line) for line in text.splitlines() if '"msg": "starting"' in line]
    assert starting["socket"] == "fd 3 from the runtime (NRI_PLUGIN_SOCKET)"
    [ended] = [json.loads(line) for line in text.splitlines() if "not reconnecting" in line]
    assert ended["why"] == LAUNCHED_ENDED
    assert text.splitlines()[-1] == f"error: {LAUNCHED_ENDED}"
    assert proc.returncode == 1


# -- docs ----------------------------------------------------------------------------------------------


def test_deploy_doc_names_files_that_exist() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    named = set(re.findall(r"\bpackaging/[\w./-]+\w", text))
    assert named
    # What packaging/build-image.sh makes (git ignores it): named by the doc, absent from a clean clone.
    made = {
        line.strip("/") for line in (ROOT / ".gitignore").read_text().splitlines() if "packaging/" in line
    }
    assert made == {"packaging/wheelhouse"}
    for name in sorted(named - made):
        assert (ROOT / name).exists(), name
