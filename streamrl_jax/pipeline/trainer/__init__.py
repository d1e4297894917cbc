"""The trainer side of a run: the worker that trains each step and publishes weights (worker), its protocol to the
controller (control), the session both the in-process run and the trainer program share (session), and the program
of a trainer across processes (program)."""
