"""Per-step planning of every phase (encoders, backbone) and the background planner."""
