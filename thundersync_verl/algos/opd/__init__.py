"""On-policy distillation streamed per agent turn: the turn teacher, the planner, the trainer step."""
