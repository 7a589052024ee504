"""A deterministic simulation of the data plane (see `tests.sim.simulation`)."""
