"""A plain PyTorch loop: load the global model, SGD over the client's mini-batches, reply."""

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from plainfedavg.task import workload

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    wl = workload(context.run_config)
    client = int(context.node_config["partition-id"])
    rnd = int(msg.content["config"]["server-round"]) - 1
    model = wl.new_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=wl.lr_at(rnd))
    x, y = wl.train.x, wl.train.y
    batches = wl.batch_indices(client, rnd)
    for _ in range(wl.steps_for(client, rnd)):
        idx = next(batches)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"num-examples": wl.num_examples(client), "train-loss": float(loss)})})
    return Message(content=content, reply_to=msg)
