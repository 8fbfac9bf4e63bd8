"""Flower's legacy API: the adapter that runs the DP wrapper under the legacy workflow (`adapter.LegacyDPFedAvg`),
the wrapper in the signature of Flower's legacy DP wrappers (`wrapper.LegacyDifferentialPrivacy`), their log
(`log`) and their forms under SecAgg+ (`secagg`)."""
