"""The driver side of a streamed step: verl trainer hooks, the loop, planning, arrivals, dispatch."""
