"""The examples/ jobs, run for real through the `azulite` console script."""
