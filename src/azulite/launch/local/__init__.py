"""The local backend: jobs as real processes on this machine (torchrun agents, TF workers, mpirun),
one detached supervisor per job, state in SQLite. Kept import-light: the rank runner lives here too."""
