"""A legacy Flower app (NumPyClient, server_fn) made private with dpfl's legacy adapter and mod."""
