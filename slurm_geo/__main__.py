from slurm_geo.cli import main

main()
