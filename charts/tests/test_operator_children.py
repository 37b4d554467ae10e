"""What the operator creates for an SDD validates like the chart's own manifests:
built-in kinds with kubernetes-validate (strict), the ServiceMonitor against its CRD
schema.  (The RayCluster is KubeRay's kind; no schema of it ships here.)"""

from __future__ import annotations

import pytest
import yaml

from specd.operator import children
from specd.operator.children import ChildOptions, Owner
from specd.workers.config import SpecDecodeDeployment

from .conftest import REPO

EXAMPLES = ["gpu-eagle3-tree.yaml", "adaptive.yaml", "external-ray.yaml"]


@pytest.mark.parametrize("example", EXAMPLES)
def test_operator_children_validate(example, validate_doc):
    sdd = SpecDecodeDeployment.model_validate(
        yaml.safe_load((REPO / "examples" / example).read_text())
    )
    owner = Owner(sdd.metadata.name, "default", "0b7e7a52-1c1e-4a49-9f0c-2f7d7b1f6d11")
    docs = [
        children.build_configmap(sdd, owner),
        children.build_admin_secret(owner, "t0ken"),
        children.build_gateway_deployment(sdd, owner, ChildOptions()),
        children.build_service(owner),
        children.build_servicemonitor(sdd, owner),
    ]
    for doc in docs:
        validate_doc(doc)


def test_a_wrong_servicemonitor_field_is_caught(validate_doc):
    """The strict schema check can fail: a misspelt relabeling field is refused."""
    sdd = SpecDecodeDeployment.model_validate(
        yaml.safe_load((REPO / "examples" / "gpu-eagle3-tree.yaml").read_text())
    )
    monitor = children.build_servicemonitor(sdd, Owner(sdd.metadata.name, "default", "u"))
    monitor["spec"]["endpoints"][0]["relabelings"][0]["target_label"] = "x"
    with pytest.raises(Exception, match="target_label"):
        validate_doc(monitor)
