"""Running asyncrl on Ray clusters: a local loopback cluster for Ray Jobs, and manifests for remote ones."""
