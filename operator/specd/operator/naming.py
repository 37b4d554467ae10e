"""Child names, labels and selectors: every place that names a child asks here."""

from __future__ import annotations

CONFIG_FILE = "deployment.yaml"
CONFIG_DIR = "/etc/specd"
API_KEYS_DIR = "/etc/specd-auth"  # the gateway's API keys, from spec.auth.apiKeySecret
API_KEYS_FILE = "api-keys"
ADMIN_TOKEN_DIR = "/etc/specd-admin"  # the gateway's admin token, from the SDD's own Secret
ADMIN_TOKEN_KEY = "token"  # the Secret's key and the file's name
GATEWAY_PORT = 8000
RAY_GCS_PORT = 6379
CONFIG_HASH_KEY = "configHash"
CONFIG_HASH_ANNOTATION = "specd.dev/config-hash"
DEPLOYMENT_LABEL = "specd.dev/deployment"
COMPONENT_LABEL = "specd.dev/component"


def configmap_name(sdd: str) -> str:
    return f"{sdd}-config"


def admin_secret_name(sdd: str) -> str:
    """The Secret holding the gateway's admin token (made once, never rotated)."""
    return f"{sdd}-admin-token"


def raycluster_name(sdd: str) -> str:
    return f"{sdd}-ray"


def gateway_name(sdd: str) -> str:
    """The gateway Deployment, its Service and its ServiceMonitor share this name."""
    return f"{sdd}-gateway"


def ray_head_address(sdd: str, namespace: str) -> str:
    """The GCS address of the managed RayCluster (KubeRay names its head Service so)."""
    return f"{raycluster_name(sdd)}-head-svc.{namespace}.svc:{RAY_GCS_PORT}"


def gateway_url(sdd: str, namespace: str) -> str:
    return f"http://{gateway_name(sdd)}.{namespace}.svc:{GATEWAY_PORT}"


def labels(sdd: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "specd",
        "app.kubernetes.io/instance": sdd,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "specd-operator",
        DEPLOYMENT_LABEL: sdd,
        COMPONENT_LABEL: component,
    }


def selector_labels(sdd: str, component: str) -> dict[str, str]:
    return {DEPLOYMENT_LABEL: sdd, COMPONENT_LABEL: component}


def selector(sdd: str, component: str) -> str:
    """``selector_labels`` as a label-selector string (status.selector, for HPA)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(sdd, component).items())
