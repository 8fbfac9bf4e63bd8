"""The foreign app's ClientApp (Message API). The one dpfl line: `mods=[dp_privatize_mod]` on train."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpfl import dp_privatize_mod  # dpfl, installed on the node
from foreign.task import CLASSES, blobs, train

app = ClientApp()


@app.train(mods=[dp_privatize_mod])
def fit(msg: Message, context: Context) -> Message:
    pid = int(context.node_config.get("partition-id", 0))
    classes = int(context.node_config.get("classes", CLASSES))  # a node can be configured with another model
    x, y = blobs(200, seed=1 + pid)
    weights = msg.content["arrays"].to_numpy_ndarrays()
    if weights[0].shape[1] != classes:  # this node's model: same task, `classes` outputs
        weights = [weights[0][:, :classes], weights[1][:classes]]
    weights = train(weights, x, y)
    return Message(
        RecordDict({"arrays": ArrayRecord(weights), "metrics": MetricRecord({"num-examples": len(y)})}), reply_to=msg
    )
