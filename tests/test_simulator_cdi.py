"""CDI injection in the runtime simulator: a container created with CDI device names gets the env edits
of their spec files (real files in tmp dirs) before any plugin sees it, as containerd and CRI-O do; a
name no spec defines fails the creation with the runtimes' message and no plugin is called. The spec
reading itself (precedence, conflicts, bad files, YAML) is checked on `CdiSpecs` directly."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from mixedcpu_support import GUARD, plugin_running
from test_simulator_adjustments import Scripted, make_container, make_pod, reply

from nri_plugin.nri.cdispecs import CdiError, CdiSpecs, apply_env
from nri_plugin.nri.identity import Identity
from nri_plugin.nri.simulator import CdiInjectionFailed, RuntimeSimulator, env_of

KIND = "example.com/widget"


def write_spec(
    directory: Path,
    name: str,
    devices: dict[str, list[str]],
    *,
    kind: str = KIND,
    spec_env: list[str] | None = None,
) -> Path:
    """A CDI spec file `name` in `directory`: one device per entry of `devices` (its env edits)."""
    spec: dict[str, Any] = {
        "cdiVersion": "0.6.0",
        "kind": kind,
        "devices": [{"name": device, "containerEdits": {"env": env}} for device, env in devices.items()],
    }
    if spec_env is not None:
        spec["containerEdits"] = {"env": spec_env}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(spec))
    return path


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "nri.sock"


@pytest.mark.asyncio
async def test_a_cdi_device_s_env_edits_are_in_the_container_plugins_see(
    socket_path: Path, tmp_path: Path
) -> None:
    cdi_dir = tmp_path / "cdi"
    plugin = Scripted(reply(env=[("FROM_PLUGIN", "1")]))
    async with (
        RuntimeSimulator(socket_path) as sim,
        plugin_running(plugin, socket_path, identity=Identity(name="a", index="10")),
    ):
        sim.cdi = CdiSpecs([cdi_dir])
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(make_pod())
        # Written after the runtime started, just before the creation (as a DRA driver's prepare does).
        write_spec(
            cdi_dir,
            "example.com-widget_claim-1.json",
            {"w1": ["WIDGET=one", "KEEP=replaced"], "w2": ["WIDGET_TWO=2"]},
            spec_env=["WIDGET_SPEC=all"],
        )
        result = await sim.create_container(make_container(), cdi_devices=[f"{KIND}=w1", f"{KIND}=w2"])
    [(_, seen)] = plugin.seen
    # KEEP is replaced where it stood; the others come at the end, the spec's own edit first.
    assert list(seen.env) == [
        "PATH=/bin",
        "KEEP=replaced",
        "SHARED=old",
        "MY_SHARED=1",
        "DROP=x",
        "SHARED=older",
        "NOTE=a\nSHARED=b",
        "WIDGET_SPEC=all",
        "WIDGET=one",
        "WIDGET_TWO=2",
    ]
    env = env_of(result.container)
    assert (env["WIDGET"], env["WIDGET_TWO"], env["FROM_PLUGIN"]) == ("one", "2", "1")
    assert env_of(sim.containers["c1"])["WIDGET"] == "one"


@pytest.mark.asyncio
async def test_an_unknown_cdi_device_fails_the_creation_before_any_plugin(
    socket_path: Path, tmp_path: Path
) -> None:
    cdi_dir = tmp_path / "cdi"
    write_spec(cdi_dir, "widgets.json", {"w1": ["WIDGET=one"]})
    plugin = Scripted()
    async with (
        RuntimeSimulator(socket_path) as sim,
        plugin_running(plugin, socket_path, identity=Identity(name="a", index="10")),
    ):
        sim.cdi = CdiSpecs([cdi_dir])
        await sim.wait_for_plugins(1, GUARD)
        await sim.run_pod_sandbox(make_pod())
        missing = [f"{KIND}=w1", f"{KIND}=gone", "other.com/x=y"]
        with pytest.raises(CdiInjectionFailed) as failed:
            await sim.create_container(make_container(), cdi_devices=missing)
        assert str(failed.value) == (
            "failed to create container c1: CDI device injection failed: "
            f"unresolvable CDI devices {KIND}=gone, other.com/x=y"
        )
        assert plugin.seen == []
        assert [r for r in sim.records if r.event == "CreateContainer"] == []
        assert "c1" not in sim.containers
        # No spec directory at all: nothing resolves.
        sim.cdi = CdiSpecs()
        with pytest.raises(CdiInjectionFailed, match=re.escape(f"unresolvable CDI devices {KIND}=w1") + "$"):
            await sim.create_container(make_container(), cdi_devices=[f"{KIND}=w1"])
        # Without CDI devices the creation goes on as ever.
        await sim.create_container(make_container())
        assert len(plugin.seen) == 1


def test_a_later_directory_overrides_an_earlier_one_and_a_conflict_in_one_resolves_nothing(
    tmp_path: Path,
) -> None:
    static, dynamic = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    write_spec(static, "a.json", {"w1": ["WHERE=etc"], "w2": ["WHERE=etc"]})
    write_spec(dynamic, "b.json", {"w1": ["WHERE=run"]})
    specs = CdiSpecs([static, dynamic])
    assert specs.env_edits([f"{KIND}=w1"]) == ["WHERE=run"]
    assert specs.env_edits([f"{KIND}=w2"]) == ["WHERE=etc"]
    assert not specs.errors
    # Two files of one directory defining w1: neither is used, and the conflict is said.
    write_spec(dynamic, "c.json", {"w1": ["WHERE=run-too"]})
    with pytest.raises(CdiError, match="^" + re.escape(f"unresolvable CDI devices {KIND}=w1") + "$"):
        specs.env_edits([f"{KIND}=w1"])
    [conflict] = specs.errors
    assert conflict.startswith(f"conflicting device '{KIND}=w1' (specs ")


def test_bad_spec_files_are_skipped_and_said_others_still_count(tmp_path: Path) -> None:
    cdi_dir = tmp_path / "cdi"
    write_spec(cdi_dir, "good.json", {"w1": ["WIDGET=one"]})
    (cdi_dir / "broken.json").write_text("{not json")
    (cdi_dir / "nokind.json").write_text(json.dumps({"cdiVersion": "0.6.0", "devices": [{"name": "x"}]}))
    write_spec(cdi_dir, "badenv.json", {"w9": ["=nameless"]}, kind="example.com/bad")
    (cdi_dir / "notes.txt").write_text("not a spec: ignored")
    (cdi_dir / "sub.json").mkdir()  # a directory: ignored, not recursed into
    specs = CdiSpecs([cdi_dir, tmp_path / "absent"])
    assert specs.env_edits([f"{KIND}=w1"]) == ["WIDGET=one"]
    assert sorted(Path(error.partition(":")[0]).name for error in specs.errors) == [
        "badenv.json",
        "broken.json",
        "nokind.json",
    ]
    assert any("invalid environment variable '=nameless'" in error for error in specs.errors)
    with pytest.raises(CdiError, match="^" + re.escape("unresolvable CDI devices example.com/bad=w9") + "$"):
        specs.env_edits(["example.com/bad=w9"])


def test_a_yaml_spec_is_read_too(tmp_path: Path) -> None:
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    (cdi_dir / "widgets.yaml").write_text(
        "cdiVersion: 0.6.0\n"
        f"kind: {KIND}\n"
        "containerEdits:\n  env: [SPEC=1]\n"
        "devices:\n"
        "  - name: w1\n"
        "    containerEdits:\n"
        "      env: [WIDGET=one]\n"
        "      deviceNodes: [{path: /dev/null}]\n"  # read, not simulated
    )
    assert CdiSpecs([cdi_dir]).env_edits([f"{KIND}=w1"]) == ["SPEC=1", "WIDGET=one"]


def test_apply_env_replaces_the_last_entry_of_a_name_in_place_or_appends() -> None:
    env = ["A=1", "B=2", "A=3"]
    apply_env(env, ["A=new", "C=4", "AA=5", "C=6"])
    assert env == ["A=1", "B=2", "A=new", "C=6", "AA=5"]
