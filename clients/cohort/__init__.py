"""Node cohorts: a SuperNode hosting several clients of the population (`hosting`); the one message that carries
their records between the server and the node is `dpcore.privacy.packing`'s."""
