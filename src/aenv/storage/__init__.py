"""Images and layers: template base images, per-sandbox writable layers, memory files."""
