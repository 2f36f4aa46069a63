"""The training wing: the loop, the engine that runs it on one or many processes, and the run's services
(output directory, lock, checkpoints, resume checks, logging, trackers, fault points)."""
