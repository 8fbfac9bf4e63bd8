"""The learning task, neutral to both sides: datasets and partitions (`data`), the model zoo
(`models`) and torch helpers (`torch_helpers`: weights in and out, evaluation, gradients).

Nothing here imports `strategies`, `clients` or the app wiring in `fl_app`.
"""
