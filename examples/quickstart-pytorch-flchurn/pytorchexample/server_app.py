"""pytorchexample: A Flower / PyTorch app."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from server_app.dropin import with_availability
from strategies import build_strategy

from pytorchexample.task import Net, load_centralized_dataset, test

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""

    # Read run config
    fraction_evaluate: float = context.run_config["fraction-evaluate"]
    num_rounds: int = context.run_config["num-server-rounds"]
    lr: float = context.run_config["learning-rate"]
    run_config = context.run_config
    # flchurn: offline clients are not connected (a client is its node's partition-id)
    grid = with_availability(grid, run_config["availability"], num_clients=run_config["num-clients"],
                             seed=run_config["schedule-seed"], results_dir=run_config["results-dir"])

    # Load global model
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize the strategy: Flower's FedAvg taking whoever is online (its minimums of 2 wait for
    # ever under churn), or one of flchurn's rules (N = num-clients: the nodes connected in round 1
    # are only the online ones)
    if run_config["strategy"] == "flower-fedavg":
        strategy = FedAvg(fraction_evaluate=fraction_evaluate, min_available_nodes=0, min_train_nodes=0,
                          min_evaluate_nodes=0)
    else:
        strategy = build_strategy(run_config["strategy"], fraction_evaluate=fraction_evaluate,
                                  num_clients=run_config["num-clients"])

    # Start strategy, run FedAvg for `num_rounds`
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=lambda server_round, arrays: global_evaluate(server_round, arrays, run_config),
    )

    # Save final model to disk
    print("\nSaving final model to disk...")
    state_dict = result.arrays.to_torch_state_dict()
    torch.save(state_dict, "final_model.pt")


def global_evaluate(server_round: int, arrays: ArrayRecord, run_config) -> MetricRecord:
    """Evaluate model on central data."""

    # Load the model and initialize it with the received weights
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)

    # Load entire test set
    test_dataloader = load_centralized_dataset(run_config["data-dir"], run_config["max-examples"])

    # Evaluate the global model on the test set
    test_loss, test_acc = test(model, test_dataloader, device)

    # Return the evaluation metrics
    return MetricRecord({"accuracy": test_acc, "loss": test_loss})
