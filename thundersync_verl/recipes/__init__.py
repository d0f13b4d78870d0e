"""Recipe rules and ``thundersync recipes check``: every shipped recipe checked as a launch would."""
