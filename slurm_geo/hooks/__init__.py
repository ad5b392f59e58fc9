"""Slurm hooks of geo jobs: node Prolog/Epilog and PrologSlurmctld/EpilogSlurmctld."""
