"""The parts of the DP wrapper, the ground of `strategies`: the part protocol (`part.Part`) and the roles a part
fills (`roles`: selection, mechanism, codec, noise), the words of a reply's rules (`reply_rules`), and every shipped
part: noise placement, the Gaussian and Haar-wavelet mechanisms, sampling, adaptive clipping, DP-FTRL (tree and
matrix factorization), the top-k codec, the audit canaries and secure aggregation. Nothing here imports the
round loop (`strategies.loop`) or an algorithm; tests/test_architecture.py holds it so."""
