"""Device backends for the engine's layers: each registers, per layer type, the ops its
device runs (engine/ops/device_layer.py); `prepare.prepare_model` gives a loaded model's
layers theirs. The torch ops in engine/ops are the CPU's and every other device's."""
