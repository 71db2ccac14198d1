"""Kubernetes' DNS-1123 label and subdomain rules (`nri_plugin.common.k8snames`)."""

from __future__ import annotations

import pytest

from nri_plugin.common.k8snames import is_dns_label, is_dns_subdomain


@pytest.mark.parametrize("text", ["a", "telco", "shared-cpus-0", "0abc9", "a" * 63])
def test_labels_kubernetes_accepts(text: str) -> None:
    assert is_dns_label(text)


@pytest.mark.parametrize("text", ["", "A", "-a", "a-", "a.b", "a_b", "a" * 64, "é"])
def test_labels_kubernetes_refuses(text: str) -> None:
    assert not is_dns_label(text)


@pytest.mark.parametrize(
    "text", ["node-1", "shared-cpus.mixed-cpu.openshift.io", "a.b.c", ("a" * 63 + ".") * 3 + "a" * 61]
)
def test_subdomains_kubernetes_accepts(text: str) -> None:
    assert len(text) <= 253
    assert is_dns_subdomain(text)


@pytest.mark.parametrize("text", ["", ".a", "a.", "a..b", "a.-b", "a-.b", "Node", "a/b", "a" * 254])
def test_subdomains_kubernetes_refuses(text: str) -> None:
    assert not is_dns_subdomain(text)


def test_a_shorter_bound_where_a_field_has_one() -> None:
    assert is_dns_subdomain("a" * 63, 63)
    assert not is_dns_subdomain("a" * 64, 63)
