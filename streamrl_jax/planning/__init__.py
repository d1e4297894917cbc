"""A run planned before it is paid for (`streamrl plan`): its trainer's and sampler's programs compiled for a TPU
topology (or this machine's devices) on its own meshes, their memory against the chips', their roofline time, and the
simulator's samples/s at the device split."""
