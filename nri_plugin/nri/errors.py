"""What a plugin's handler raises to refuse a request, in NRI's terms, not the transport's.

The stub answers the runtime with the matching ttrpc status code (gRPC's numbering) and the
exception's message, which the runtime shows to kubelet (``CreateContainerError``) or logs. Any other
exception out of a handler is a bug: the stub answers it as ``Internal``.
"""

from __future__ import annotations

from nri_plugin.ttrpc.errors import Code


class PluginRefusal(Exception):
    """Base of the refusals; `code` is the gRPC status code the runtime receives."""

    code: Code = Code.INTERNAL


class InvalidRequest(PluginRefusal):
    """The request can never succeed as written (a pod spec to fix)."""

    code = Code.INVALID_ARGUMENT


class PreconditionFailed(PluginRefusal):
    """The request is right but the node is not in a state to grant it (cgroup, config, topology)."""

    code = Code.FAILED_PRECONDITION


class PluginFailure(PluginRefusal):
    """The plugin could not do its part (its state cannot be saved, ...)."""

    code = Code.INTERNAL
