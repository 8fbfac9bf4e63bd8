"""The neutral privacy core: what the server strategies and the clients both use.

- `mechanisms`: clipping, Gaussian noise, top-k sparsification, Haar-wavelet noise;
- `ledger`: the privacy ledgers (client level, per-client sample level) behind one interface;
- `dpsgd_noise`: the noise multipliers of DP-SGD and DP-SGD-WAV, and the step budget R_c;
- `settings`: the allowed values of the DP settings and the rules between them;
- `protocol`: the keys of the train config and of the metrics that clients and strategies exchange.
- `figures`: every figure a run writes, declared once (name, file, log line, dashboard tag, guarantee mark).

Nothing here imports `strategies`, `clients` or the app wiring in `fl_app`
(tests/test_architecture.py checks it).
"""
