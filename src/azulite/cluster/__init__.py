"""azulite.cluster: node pools, GPU-aware gang scheduling, autoscaling, spot evictions and checkpoint
intervals (Young/Daly) as a discrete-event simulator; the cost model and the planner built on it."""
