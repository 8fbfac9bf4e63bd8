"""The neutral privacy core: what the server strategies and the clients both use.

- `mechanisms`: clipping, Gaussian noise, top-k sparsification, Haar-wavelet noise;
- `accountants`: eps(delta) of composed releases, one class per accountant behind a registry (PLD, RDP, PRV);
- `calibration`: the noise multiplier for a target epsilon, delta's default, the multipliers of noise shares;
- `ledger`: the privacy ledgers (client level, per-client sample level, DP-FTRL's trees) behind one interface;
- `dpsgd_noise`: the noise multipliers of DP-SGD and DP-SGD-WAV, and the step budget R_c;
- `settings`: the allowed values of the DP settings and the rules between them;
- `protocol`: the keys of the train config and of the metrics that clients and strategies exchange.
- `figures`: every figure a run writes, declared once (name, file, log line, dashboard tag, guarantee mark).

Nothing here imports `strategies`, `clients` or the app wiring in `fl_app`
(tests/test_architecture.py checks it).
"""
