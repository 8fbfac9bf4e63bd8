"""ClientApp as in Flower's quickstart-pytorch: load the named state dict, train, reply with the new weights.

`app` is the unchanged client (central noise needs nothing more); `app_with_mod` is the same client with the
one line distributed noise needs: `mods=[dp_privatize_mod]` on train."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpfl.clients.mods import dp_privatize_mod
from quickstart.task import Net, load_data, test, train


def train_fn(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainset, _ = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    loss = train(model, trainset, int(context.run_config["local-epochs"]), float(context.run_config["lr"]))
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train_loss": loss, "num-examples": len(trainset[1])}),
        }
    )
    return Message(content=content, reply_to=msg)


def evaluate_fn(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, testset = load_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    loss, accuracy = test(model, testset)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(testset[1])})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


app = ClientApp()
app.train()(train_fn)
app.evaluate()(evaluate_fn)

app_with_mod = ClientApp()
app_with_mod.train(mods=[dp_privatize_mod])(train_fn)
app_with_mod.evaluate()(evaluate_fn)
