"""The app's NumPyClient, unchanged; the one dpfl line: `mods=[dp_privatize_mod]` on the ClientApp."""

from flwr.app import Context
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp

from dpfl.clients.mods import dp_privatize_mod
from legacyapp.task import accuracy, shard, train


class DigitsClient(NumPyClient):
    def __init__(self, pid: int, n: int) -> None:
        self.x, self.y = shard(pid, n)

    def fit(self, parameters, config):
        return train(parameters, self.x, self.y), len(self.y), {"train-loss-ish": 1.0}

    def evaluate(self, parameters, config):
        return 0.5, len(self.y), {"accuracy": accuracy(parameters, self.x, self.y)}


def client_fn(context: Context):
    node = context.node_config
    return DigitsClient(int(node["partition-id"]), int(node["num-partitions"])).to_client()


app = ClientApp(client_fn=client_fn, mods=[dp_privatize_mod])
