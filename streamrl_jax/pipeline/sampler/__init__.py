"""The sampler side of a run: the worker that takes leases and generates (worker), the groups it scores and ships
(groups), and the program of a sampler across processes (program)."""
