"""The learning task, neutral to both sides: the dataset catalogue (`catalogue`), loading
(`data`, reading `data_files` into the `data_cache`) and partitions (`partitions`), the model zoo
(`models`) and torch helpers (`torch_helpers`: weights in and out, evaluation, gradients).

Nothing here imports `strategies`, `clients` or the app wiring in `fl_app`.
"""
