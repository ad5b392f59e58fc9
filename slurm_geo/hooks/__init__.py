"""Slurm hooks of geo jobs: node Prolog/Epilog, PrologSlurmctld/EpilogSlurmctld, and the
SPANK plugin's validator of --geo-* directives."""
