"""Training: mixed SFT (TRL SFTTrainer) and the one on-policy loop (expert RL and MOPD)."""
