"""What `streamrl train` runs around the RL steps: the job's settings and model (config), the supervised warm-up
(warmup) and the one held-out evaluation every path uses (evaluation). What the job leaves in its workdir is
written by `records`."""
