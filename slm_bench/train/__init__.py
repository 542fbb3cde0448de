"""One training engine on accelerate, and the objectives it optimises as small classes (causal LM, verifier, DPO; PPO's online loop goes here too)."""
