"""`python -m replicator`: the same command line as the `replicator` script."""

from replicator.coordinator.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
