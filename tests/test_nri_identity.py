"""The plugin's identity, worked out once (`nri_plugin.nri.identity`): each source of the name and
index, their order, the old runtimes' ``NN-name`` in NRI_PLUGIN_NAME, the handed-over connection,
and that the stub takes what it is given instead of reading the environment again."""

from __future__ import annotations

import pytest

from nri_plugin.nri.identity import (
    Identity,
    IdentityError,
    resolve_identity,
)
from nri_plugin.nri.stub import Stub

ENV = {"NRI_PLUGIN_NAME": "env-name", "NRI_PLUGIN_IDX": "20"}
LAUNCHED = "/opt/nri/plugins/30-file-name"


def resolved(**kwargs: object) -> tuple[str, str, str, str]:
    found = resolve_identity(**{"environ": {}, **kwargs})  # type: ignore[arg-type]
    return found.name, found.index, found.name_from, found.index_from


def test_each_source_alone() -> None:
    assert resolved(name="opt", index="40") == ("opt", "40", "option", "option")
    assert resolved(environ=ENV) == (
        "env-name",
        "20",
        "environment (NRI_PLUGIN_NAME)",
        "environment (NRI_PLUGIN_IDX)",
    )
    from_file = "executable name (30-file-name)"
    assert resolved(executable=LAUNCHED) == ("file-name", "30", from_file, from_file)
    # Split at the first dash only, once: the rest is the name.
    assert resolved(executable="/x/10-20-y")[:2] == ("20-y", "10")
    assert resolved(default_name="cfg", default_index="50", defaults_from="the config") == (
        "cfg",
        "50",
        "the config",
        "the config",
    )


@pytest.mark.parametrize(
    ("kwargs", "full_name"),
    [
        ({"name": "opt", "index": "40"}, "40-opt"),  # options beat everything
        ({}, "20-env-name"),  # then the environment
        ({"environ": {}}, "30-file-name"),  # then the executable's NN-name
        ({"environ": {}, "executable": "/usr/bin/mixed-cpu-nri-plugin"}, "50-cfg"),  # then the config
        ({"name": "opt"}, "20-opt"),  # each part on its own: the option's name, the environment's index
        ({"environ": {"NRI_PLUGIN_IDX": "21"}}, "21-file-name"),
        ({"environ": {"NRI_PLUGIN_NAME": "", "NRI_PLUGIN_IDX": ""}}, "30-file-name"),  # empty: no value
    ],
    ids=["options", "environment", "executable", "config", "mixed", "index-only", "empty-variables"],
)
def test_the_first_source_that_has_a_part_gives_it(kwargs: dict[str, object], full_name: str) -> None:
    arguments: dict[str, object] = {
        "environ": ENV,
        "executable": LAUNCHED,
        "default_name": "cfg",
        "default_index": "50",
        **kwargs,
    }
    assert resolve_identity(**arguments).full_name == full_name  # type: ignore[arg-type]


def test_an_old_runtimes_whole_file_name_is_cut_and_gives_the_index_only_when_none_is_set() -> None:
    """NRI v0.3 and older put "NN-name" in NRI_PLUGIN_NAME."""
    alone = resolved(environ={"NRI_PLUGIN_NAME": "05-mixed-cpu"}, default_index="10")
    assert alone == ("mixed-cpu", "05", "environment (NRI_PLUGIN_NAME)", "environment (NRI_PLUGIN_NAME)")
    with_index = resolved(environ={"NRI_PLUGIN_NAME": "05-mixed-cpu", "NRI_PLUGIN_IDX": "07"})
    assert with_index[:2] == ("mixed-cpu", "07")
    # The option's index still beats the environment's, whichever variable holds it.
    assert resolved(index="40", environ={"NRI_PLUGIN_NAME": "05-mixed-cpu"})[:2] == ("mixed-cpu", "40")


def test_only_an_nn_name_executable_names_the_plugin() -> None:
    for executable in ("/usr/bin/mixed-cpu-nri-plugin", "/x/1-a", "/x/100-a", "/x/10-", "", "/x/10-a/"):
        with pytest.raises(IdentityError, match="no plugin index"):
            resolve_identity(environ={}, executable=executable)
    with pytest.raises(IdentityError, match="no plugin name: set NRI_PLUGIN_NAME"):
        resolve_identity(environ={"NRI_PLUGIN_IDX": "10"}, executable="/usr/bin/plugin")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"index": "7"},
            "plugin index '7' is invalid: use exactly two digits, e.g. 10 (it came from option)",
        ),
        (
            {"environ": {"NRI_PLUGIN_IDX": "100"}},
            "plugin index '100' is invalid: use exactly two digits, e.g. 10 (it came from environment "
            "(NRI_PLUGIN_IDX))",
        ),
        (
            {"environ": {"NRI_PLUGIN_NAME": "bad name"}},
            "plugin name 'bad name' is invalid: use letters, digits and _ . + - only, e.g. mixed-cpu (it "
            "came from environment (NRI_PLUGIN_NAME))",
        ),
        (
            {"executable": "/opt/nri/plugins/10-bad:name"},
            "plugin name 'bad:name' is invalid: use letters, digits and _ . + - only, e.g. mixed-cpu (it "
            "came from executable name (10-bad:name))",
        ),
    ],
    ids=["option", "environment-index", "environment-name", "executable"],
)
def test_a_refused_part_names_where_it_came_from(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"environ": {}, "default_name": "cfg", "default_index": "50", **kwargs}
    with pytest.raises(IdentityError) as info:
        resolve_identity(**arguments)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_the_handed_over_connection_is_read_with_the_rest() -> None:
    base = {"NRI_PLUGIN_NAME": "x", "NRI_PLUGIN_IDX": "10"}
    assert resolve_identity(environ={**base, "NRI_PLUGIN_SOCKET": "3"}).inherited_fd == 3
    assert resolve_identity(environ=base).inherited_fd is None
    assert resolve_identity(environ={**base, "NRI_PLUGIN_SOCKET": ""}).inherited_fd is None
    for bad in ("x", "-1", "\uff13"):  # the last: a full-width digit three
        with pytest.raises(IdentityError, match="is not a file descriptor number"):
            resolve_identity(environ={**base, "NRI_PLUGIN_SOCKET": bad})


class _Creates:
    async def create_container(self, pod: object, container: object) -> None:
        return None


def test_the_stub_takes_its_identity_and_does_not_read_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the process's environment says reaches the stub only through the identity handed to it."""
    monkeypatch.setenv("NRI_PLUGIN_NAME", "env-name")
    monkeypatch.setenv("NRI_PLUGIN_IDX", "20")
    monkeypatch.setenv("NRI_PLUGIN_SOCKET", "not-a-number")  # read, this would be refused
    given = Identity(name="given", index="10")
    stub = Stub(_Creates(), identity=given, socket_path="/nonexistent")
    assert stub.identity is given
    assert (stub.inherited_fd, stub.reconnect) == (None, True)
    handed = Identity(name="given", index="10", inherited_fd=7)
    launched = Stub(_Creates(), identity=handed, socket_path="/nonexistent")
    assert (launched.inherited_fd, launched.reconnect) == (7, False)
