"""The local stack that `duality up` runs on this machine, one module per component."""
