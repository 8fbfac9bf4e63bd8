"""A Flower quickstart-style app (PyTorch, named state dicts) made private by swapping in dpfl's wrapper."""
