"""The roles a node runs in a training run: trainer, inferer, and the runner that picks one on ``join``."""
