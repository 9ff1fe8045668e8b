"""The optimizers by name (``optim.name``): one file each with its options (``registry.OPTIMIZERS``)."""
