"""pytorch-example: A Flower / PyTorch app.

Flower's ``CustomFedAvg`` (its own ``configure_train`` with a learning-rate schedule and its own
``start`` loop), unchanged but for two things: W&B logging is left out (offline), and the class
is built over a base of the run's choice by :func:`custom_strategy`, so that one of flchurn's
rules can take FedAvg's place under the same subclass (``class CustomFedAvg(FedAU)`` is all a
user with one rule in mind writes).
"""

import io
import json
import os
import time
from collections.abc import Callable, Iterable
from logging import INFO
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log, logger
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info


def custom_strategy(base: type[Strategy] = FedAvg) -> type[Strategy]:
    """The example's ``CustomFedAvg`` over ``base`` (Flower's FedAvg, or a rule class)."""

    class CustomFedAvg(base):  # type: ignore[valid-type,misc]
        """A class that behaves like FedAvg but has extra functionality added into the
        `start` method. It also overrides `configure_train` to implement a simple learning
        rate schedule.

        This strategy: (1) saves results to the filesystem each rounds, (2)
        saves a checkpoint of the global model when a new best is found.
        """

        def set_save_path_and_run_dir(self, path: Path, run_dir: str):
            """Set the path where results and model checkpoints will be saved."""
            self.save_path = path
            self.run_dir = run_dir

        def _update_best_acc(self, current_round: int, accuracy: float, arrays: ArrayRecord) -> None:
            """Update best accuracy and save model checkpoint if current accuracy is
            higher."""
            if accuracy > self.best_acc_so_far:
                self.best_acc_so_far = accuracy
                logger.log(INFO, "💡 New best global model found: %f", accuracy)
                # Save the PyTorch model
                file_name = f"model_state_acc_{accuracy}_round_{current_round}.pth"
                torch.save(arrays.to_torch_state_dict(), self.save_path / file_name)
                logger.log(INFO, "💾 New best model saved to disk: %s", file_name)

        def save_metrics_as_json(self, current_round: int, result: Result) -> None:
            """Save the current results to a JSON file."""

            # Load current JSON if file exists
            if os.path.exists(f"{self.save_path}/results.json"):
                with open(f"{self.save_path}/results.json", encoding="utf-8") as fp:
                    try:
                        results = json.load(fp)
                    except json.JSONDecodeError:
                        results = []
            else:
                results = []

            # Extract metrics from current round
            last_train_metrics = dict(result.train_metrics_clientapp.get(current_round, {}))
            last_eval_client_metrics = dict(result.evaluate_metrics_clientapp.get(current_round, {}))
            last_eval_server_metrics = dict(result.evaluate_metrics_serverapp.get(current_round, {}))
            round_results = {
                "round": current_round,
                "train_metrics": last_train_metrics,
                "evaluate_metrics_clientapp": last_eval_client_metrics,
                "evaluate_metrics_serverapp": last_eval_server_metrics,
            }
            results.append(round_results)
            # Save to JSON
            with open(f"{self.save_path}/results.json", "w", encoding="utf-8") as fp:
                json.dump(results, fp)

        def configure_train(
            self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
        ) -> Iterable[Message]:
            """Configure the next round of federated training."""
            # Perform basic learning rate scheduling
            if server_round == 5:  # half LR at round 5
                config["lr"] = config["lr"] * 0.5
                logger.log(INFO, "⚙️ Adjusted learning rate to %f", config["lr"])
            # Continue with standard FedAvg configure_train
            return super().configure_train(server_round, arrays, config, grid)

        def start(
            self,
            grid: Grid,
            initial_arrays: ArrayRecord,
            num_rounds: int = 3,
            timeout: float = 3600,
            train_config: ConfigRecord | None = None,
            evaluate_config: ConfigRecord | None = None,
            evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        ) -> Result:
            """Execute the federated learning strategy saving results to disk."""

            # Keep track of best acc
            self.best_acc_so_far = 0.0

            log(INFO, "Starting %s strategy:", self.__class__.__name__)
            log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
            self.summary()
            log(INFO, "")

            # Initialize if None
            train_config = ConfigRecord() if train_config is None else train_config
            evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
            result = Result()

            t_start = time.time()
            # Evaluate starting global parameters
            if evaluate_fn:
                res = evaluate_fn(0, initial_arrays)
                log(INFO, "Initial global evaluation results: %s", res)
                if res is not None:
                    result.evaluate_metrics_serverapp[0] = res

            arrays = initial_arrays

            for current_round in range(1, num_rounds + 1):
                log(INFO, "")
                log(INFO, "[ROUND %s/%s]", current_round, num_rounds)

                # --- TRAINING (CLIENTAPP-SIDE) -------------------------------
                train_replies = grid.send_and_receive(
                    messages=self.configure_train(current_round, arrays, train_config, grid),
                    timeout=timeout,
                )

                # Aggregate train
                agg_arrays, agg_train_metrics = self.aggregate_train(current_round, train_replies)

                # Log training metrics and append to history
                if agg_arrays is not None:
                    result.arrays = agg_arrays
                    arrays = agg_arrays
                if agg_train_metrics is not None:
                    log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_train_metrics)
                    result.train_metrics_clientapp[current_round] = agg_train_metrics

                # --- EVALUATION (CLIENTAPP-SIDE) -----------------------------
                evaluate_replies = grid.send_and_receive(
                    messages=self.configure_evaluate(current_round, arrays, evaluate_config, grid),
                    timeout=timeout,
                )

                # Aggregate evaluate
                agg_evaluate_metrics = self.aggregate_evaluate(current_round, evaluate_replies)

                # Log training metrics and append to history
                if agg_evaluate_metrics is not None:
                    log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_evaluate_metrics)
                    result.evaluate_metrics_clientapp[current_round] = agg_evaluate_metrics

                # --- EVALUATION (SERVERAPP-SIDE) -----------------------------
                # Centralized evaluation
                if evaluate_fn:
                    log(INFO, "Global evaluation")
                    res = evaluate_fn(current_round, arrays)
                    log(INFO, "\t└──> MetricRecord: %s", res)
                    if res is not None:
                        result.evaluate_metrics_serverapp[current_round] = res
                        # Maybe save to disk if new best is found
                        self._update_best_acc(current_round, res["accuracy"], arrays)

                # Save metrics to disk as JSON
                self.save_metrics_as_json(current_round=current_round, result=result)

            log(INFO, "")
            log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
            log(INFO, "")
            log(INFO, "Final results:")
            log(INFO, "")
            for line in io.StringIO(str(result)):
                log(INFO, "\t%s", line.strip("\n"))
            log(INFO, "")

            return result

    return CustomFedAvg


CustomFedAvg = custom_strategy(FedAvg)  # Flower's example class, over Flower's FedAvg
