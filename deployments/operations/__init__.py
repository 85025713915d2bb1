"""Operating an app: `rayspec plan` (memory, resources), the proposer pool's autoscaling signal,
KubeRay manifests, and an example of another Serve app calling ours through a handle."""
