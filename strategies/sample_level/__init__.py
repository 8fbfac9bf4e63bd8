"""Sample-level DP: ALI-DPFL (`ali_dpfl.ALIDPFL`, the round loop with the clients' DP-SGD accounted per client),
its clients' view (`ali_dpfl_clients`) and its adaptive local iterations (`local_steps`, eq. (9) of the paper)."""
