"""The drivers' shared parts: set-up from one config, the replica loop, the simulator, checkpoints,
replay and run records."""
