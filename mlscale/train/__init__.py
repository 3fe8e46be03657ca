"""Training: the job plan, launcher, trainer loop, records, strategies, checkpoints."""
