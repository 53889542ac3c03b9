"""Reward-model training: the score head's loss (`loss.py`) and the objective (`objective.py`)."""
