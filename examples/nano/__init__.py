"""The nano model: data generators, tokenizer training, training script, export and evaluation.

Run the scripts from the repository root (`python examples/nano/train.py ...`); see README.md here.
"""
