"""Kubernetes manifests for a kiln deployment, rendered from the registered stages (``kiln k8s render``): a stage
plug-in gets its Deployment and ScaledObject without anyone writing YAML for it. See infra/k8s/README.md."""
