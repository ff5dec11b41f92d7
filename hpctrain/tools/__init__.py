"""What runs around the layers: local launch, Slurm submission, containers, doctor, report, bench."""
