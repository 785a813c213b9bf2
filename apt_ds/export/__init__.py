"""From a run to a deployable model: merged, physically smaller, dense safetensors."""
