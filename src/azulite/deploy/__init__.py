"""azulite.deploy: render a spec for AKS (Kubernetes objects) and Azure ML (job / endpoint YAML), and
the cluster itself (node pools, device plugin, DCGM exporter, alert rules). Rendering needs neither a
cluster nor the cloud SDKs; ``azulite.launch.kubernetes`` / ``azulite.launch.azureml`` send what it renders."""
