"""slurm-geo: ML training on Slurm that survives the loss of its cluster."""

__version__ = "0.1.0"
