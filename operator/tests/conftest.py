"""Fixtures: the fake cluster (`specd.operator.testing.cluster`), kopf in `KopfRunner`'s
thread, kubectl as a subprocess."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from specd.operator.testing.cluster import NAMESPACE, REPO, Cluster, load_example

__all__ = ["NAMESPACE", "REPO", "Cluster", "load_example"]


@pytest.fixture()
def cluster_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable]:
    made: list[Cluster] = []

    def make(**kwargs: Any) -> Cluster:
        cluster = Cluster(**kwargs)
        made.append(cluster)
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig(tmp_path / "kubeconfig")))
        return cluster

    yield make
    for cluster in made:
        cluster.close()


@pytest.fixture()
def cluster(cluster_factory: Callable) -> Cluster:
    return cluster_factory()
