"""The neutral core that the strategies, the clients and the apps share: DP mechanisms, the privacy ledger,
the message keys (`dpcore.privacy`), and data, models and torch helpers (`dpcore.task`). It imports none of
`strategies`, `clients` or `fl_app`."""
