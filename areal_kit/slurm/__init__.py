"""Slurm: a preset submitted with sbatch from a login node (the script, the partition's checks, the
job's state for status and logs, doctor's checks). Nothing here imports the training stack: the
job runs `areal-kit train` on its first node like any other driver, against a Ray cluster the
script starts across the job's nodes.

    areal-kit train tiny --slurm --partition gpu --time 4:00:00 --dry-run   # the sbatch script
    areal-kit status --slurm                                                # areal-kit's jobs
    areal-kit doctor --slurm --partition gpu --preset 1.5B_n4
"""
