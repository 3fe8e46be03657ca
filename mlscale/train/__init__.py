"""Training: launcher, trainer loop, strategies, checkpoints, run directory."""
