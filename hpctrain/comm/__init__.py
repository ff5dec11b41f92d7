"""The comm layer: the only code that touches mpi4py (broadcast, gradient allreduce, 16-bit wire formats)."""
