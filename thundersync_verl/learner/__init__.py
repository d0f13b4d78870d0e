"""Inside the learner's Ray actor: the streaming worker, the chunk loss, checks, and one engine each."""
