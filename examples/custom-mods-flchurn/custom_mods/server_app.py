"""custom_mods: A Flower app with custom mods."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from server_app.dropin import with_availability
from strategies import build_strategy

from custom_mods.task import Net, load_centralized_dataset, test

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""

    # Read run config
    fraction_evaluate: float = float(context.run_config["fraction-evaluate"])
    num_rounds: int = int(context.run_config["num-server-rounds"])
    lr: float = float(context.run_config["learning-rate"])

    # Load global model
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # flchurn: offline clients are not connected (a client is its node's partition-id)
    cfg = context.run_config
    grid = with_availability(grid, cfg["availability"], num_clients=cfg["num-clients"], seed=cfg["schedule-seed"],
                             results_dir=cfg["results-dir"])

    # Initialize FedAvg strategy (flchurn: or a rule). Flower waits, for ever, for min_available_nodes
    # and min_train_nodes connected nodes; under churn only the online ones are, as in a deployment
    if cfg["strategy"] == "fedavg":
        strategy = FedAvg(fraction_evaluate=fraction_evaluate, min_available_nodes=0, min_train_nodes=0,
                          min_evaluate_nodes=0)
    else:
        strategy = build_strategy(cfg["strategy"], num_clients=cfg["num-clients"], fraction_evaluate=fraction_evaluate)

    # Start strategy, run FedAvg for `num_rounds`
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=lambda rnd, arrays: global_evaluate(rnd, arrays, cfg["data-dir"], cfg["max-examples"] // 4),
    )

    # Save final model to disk
    print("\nSaving final model to disk...")
    state_dict = result.arrays.to_torch_state_dict()
    torch.save(state_dict, f"{cfg['results-dir']}/final_model.pt")


def global_evaluate(server_round: int, arrays: ArrayRecord, data_dir: str = "", max_examples: int = 10000) -> MetricRecord:
    """Evaluate model on central data."""

    # Load the model and initialize it with the received weights
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)

    # Load the test set (flchurn: the offline copy's first images)
    test_dataloader = load_centralized_dataset(data_dir, max_examples)

    # Evaluate the global model on the test set
    test_loss, test_acc = test(model, test_dataloader, device)

    # Return the evaluation metrics
    return MetricRecord({"accuracy": test_acc, "loss": test_loss})
