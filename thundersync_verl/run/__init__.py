"""Around the steps of a run: checkpoints and resume, step records, timelines, probes, faults, results."""
