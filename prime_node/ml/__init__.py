"""Machine learning: tiny model creation, the inference engine, GRPO and the trainer loop.

Everything here imports torch/transformers, so only the commands that need them import this package.
"""
