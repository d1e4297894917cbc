"""GKE launch: one JobSet per role (trainer; samplers), rendered from the run's gin config and a `GKEConfig`.

`streamrl launch gke --render OUTDIR [--apply]` writes the manifests; `launchers/README.md` walks through a
TPU v5e and an A3 launch. The rendering is pure (`render`), so tests check it field by field and run its
containers' commands locally.
"""

from streamrl_jax.gke.launch_config import (GKEConfig, GKEPortsConfig, GKESamplersConfig,
                                            GKETrainerConfig)
from streamrl_jax.gke.manifests import render, trainer_address
from streamrl_jax.gke.platforms import PLATFORMS, Platform, RoleShape

__all__ = ["GKEConfig", "GKEPortsConfig", "GKESamplersConfig", "GKETrainerConfig", "PLATFORMS", "Platform",
           "RoleShape", "render", "trainer_address"]
