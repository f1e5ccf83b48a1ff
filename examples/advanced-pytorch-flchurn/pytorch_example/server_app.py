"""pytorch-example: A Flower / PyTorch app."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from server_app.dropin import with_availability
from strategies import rule_spec
from torch.utils.data import DataLoader

from pytorch_example.strategy import CustomFedAvg, custom_strategy
from pytorch_example.task import Net, apply_eval_transforms, create_run_dir, fashion_mnist, test

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    # Read run config
    num_rounds = context.run_config["num-server-rounds"]
    fraction_train = context.run_config["fraction-train"]
    fraction_eval = context.run_config["fraction-evaluate"]
    device = context.run_config["server-device"]
    spec = str(context.run_config["strategy"])

    # Load global model
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize the strategy: Flower's FedAvg, or one of flchurn's rules, under the same subclass.
    # Under churn only the online nodes are connected (in simulation as deployed): Flower's FedAvg
    # would wait for ever for min_available_nodes / min_train_nodes of them, so take whoever is online
    if spec == "fedavg":
        strategy = CustomFedAvg(fraction_train=fraction_train, fraction_evaluate=fraction_eval,
                                min_available_nodes=0, min_train_nodes=0, min_evaluate_nodes=0)
    else:
        rule, params = rule_spec(spec)  # e.g. "fedau" -> (FedAU, {}); "fedexp:epsilon=0.01" -> (FedExP, {...})
        strategy = custom_strategy(rule)(**params, num_clients=context.run_config["num-clients"],
                                         fraction_train=fraction_train, fraction_evaluate=fraction_eval,
                                         min_available_nodes=1)

    # Define directory for results and save config
    save_path, run_dir = create_run_dir(config=context.run_config)
    strategy.set_save_path_and_run_dir(save_path, run_dir)

    # flchurn: clients join and leave by the schedule (offline clients are unreachable)
    grid = with_availability(grid, context.run_config["availability"], num_clients=context.run_config["num-clients"],
                             seed=context.run_config["schedule-seed"], results_dir=save_path)

    # Start strategy, run FedAvg for `num_rounds`
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": 0.1}),
        num_rounds=num_rounds,
        evaluate_fn=get_global_evaluate_fn(device, str(context.run_config["data-dir"]),
                                           int(context.run_config["max-examples"]) // 4),
    )

    # Save final model to disk
    print("\nSaving final model to disk...")
    state_dict = result.arrays.to_torch_state_dict()
    torch.save(state_dict, save_path / "final_model.pt")
    print(f"results: {save_path}")


def get_global_evaluate_fn(device: str, data_dir: str, max_examples: int):
    """Return an evaluation function for server-side evaluation."""

    # The test split of the same offline Fashion-MNIST the clients partition
    global_test_set = fashion_mnist("test", data_dir, max_examples)

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Evaluate model on central data."""
        testloader = DataLoader(
            global_test_set.with_transform(apply_eval_transforms),
            batch_size=32,
        )

        net = Net()
        net.load_state_dict(arrays.to_torch_state_dict())
        net.to(device)
        loss, accuracy = test(net, testloader, device=device)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    return global_evaluate
