"""hpctrain: data-parallel PyTorch training over MPI on Slurm supercomputers.

Importing this package is cheap: it neither imports torch nor initializes MPI.
"""

__version__ = "0.1.0"
