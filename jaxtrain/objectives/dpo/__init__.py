"""Direct preference optimization: its loss (`loss.py`) and its objective (`objective.py`)."""
