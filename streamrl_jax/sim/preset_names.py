"""The names of the simulator's scenarios (`sim.presets` builds them), importable without jax for `--help`."""

PAPER = {
    # name: (model, max output length, devices, tensor parallel)
    "paper-7b-5k": ("7b", 5000, 32, 1),
    "paper-32b-10k": ("32b", 10000, 64, 4),
    "paper-72b-20k": ("72b", 20000, 128, 8),
}
SCALING = "distflow-scaling"  # the trainer's data plane, central against per process, 8 to 1,024 trainer devices
SCALING_MODELS = {"7b": "paper-7b-5k", "72b": "paper-72b-20k"}  # its models, by the paper preset each grows from
PRESETS = sorted(PAPER) + ["paper-32b-h20-sampler", "cross-datacenter", "local-cpu", SCALING]
