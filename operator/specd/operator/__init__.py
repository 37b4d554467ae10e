"""specd operator: SpecDecodeDeployment CRs reconciled into a Ray actor pool (kopf).

Modules (see also docs/architecture.md):
  crd        the CRD, generated from the pydantic config models, with its CEL rules
  naming     child names, labels and selectors
  children   pure builders of the child objects (ConfigMap, RayCluster, Deployment, ...)
  status     pure: gateway /admin/status document -> CR status and conditions
  kube       a small async Kubernetes API client over kopf's credentials
  reconcile  the ordered, idempotent ensure_* steps and the gateway poll
  handlers   kopf handlers (create/update/resume/timer/delete) around `reconcile`
  metrics    the operator's own Prometheus metrics
  main       `specd operator`: settings, peering, liveness, metrics endpoint
  rbac       the API permissions it uses (the Helm chart's RBAC is tested against them)
"""
