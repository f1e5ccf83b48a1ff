"""No success without work (issue 35): a run in which no client's update was applied in any
round ends failed with the reason, in the project's own app and in any Flower app through the
drop-in (a user's mod that breaks every node)."""

import pytest
from flwr.app import Context, Error, Message, MessageType
from rich.console import Console
from test_churn_dropin import flower_fedavg, foreign_app, start

from experiments.inprocess import InProcessGrid, run_inprocess
from server_app.dropin import NoWorkDone, with_availability
from strategies import StrategyFailure
from strategies.failures import quoted_error

QUADRATIC = {"dataset": "quadratic", "model": "quadratic", "partition": "natural", "num-clients": 4,
             "num-server-rounds": 2, "local-steps": "steps:n=1", "batch-size": 1, "schedule-seed": 0,
             "progress": False, "checkpoint-every": 0, "strategy": "fedavg-active"}


def test_the_projects_app_fails_a_run_in_which_no_client_ever_took_part(tmp_path, monkeypatch):
    monkeypatch.setattr("server_app.results.plot_run", lambda *args, **kwargs: None)
    with pytest.raises(StrategyFailure, match="no client's update was applied in any of the 2 rounds"):
        run_inprocess({**QUADRATIC, "availability": "bernoulli:p=0.0", "results-dir": str(tmp_path)},
                      console=Console(quiet=True))
    run_inprocess({**QUADRATIC, "availability": "bernoulli:p=0.5", "results-dir": str(tmp_path), "run-name": "ok"},
                  console=Console(quiet=True))  # some work: a success


def broken_config_mod(msg: Message, context: Context, call_next):
    """A user's mod that needs what the identity query does not carry (Flower's tensorboard_mod
    reads msg.content["config"]["server-round"], which it now finds; this one reads a key no
    query has)."""
    _ = msg.content["config"]["lr"]
    return call_next(msg, context)


class FlowerErrors(InProcessGrid):
    """An in-process grid that turns a ClientApp's exception into the error reply a deployment's
    flwr-clientapp sends (``<class 'T'>:<'message'>``) instead of raising it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        app = self.app

        def guarded(msg, context):
            try:
                return app(msg, context)
            except Exception as ex:  # noqa: BLE001 - as Flower's runtime
                return Message(Error(code=2, reason=str(type(ex)) + ":<'" + str(ex) + "'>"), reply_to=msg)

        self.app = guarded


@pytest.mark.parametrize("rounds, when", [(5, r"in rounds 1-3"), (2, r"the run ended.* any of its 2 round")])
def test_a_users_mod_that_breaks_identity_fails_the_run_quoting_the_real_exception(rounds, when, caplog):
    """After max_idle_rounds (3) idle rounds, or when a shorter run's loop ends (Flower's start)."""
    inner = FlowerErrors(4, {}, client_app=foreign_app(extra_mods=(broken_config_mod,)))
    grid = with_availability(inner, "always", num_clients=4, identity_timeout=1.0)
    with pytest.raises(NoWorkDone, match=when + r".*KeyError: 'lr'"):
        start(flower_fedavg(), grid, rounds=rounds)
    assert "KeyError: 'lr'" in caplog.text  # the warning quotes the exception, not the mod's name


def failing_train(msg: Message, context: Context, call_next):
    """A ClientApp whose training always fails (identity answers still)."""
    if msg.metadata.message_type == MessageType.TRAIN:
        raise RuntimeError("no data on this device")
    return call_next(msg, context)


def test_a_deployed_run_shorter_than_max_idle_rounds_without_work_fails(tmp_path, monkeypatch):
    """Under ``deploy launch --app`` (its environment), 2 rounds whose every training reply is an
    error: the launcher's metrics.jsonl has both rounds with no participants, and the run fails at
    its end (before: finished:completed), naming the clients' exception."""
    from server_app.dropin import Deployed
    from server_app.results import read_metrics

    deployed = Deployed(tmp_path / "run", None, 0.0, {"spec": "always", "seed": 0, "num_clients": 4})
    for key, value in deployed.env().items():
        monkeypatch.setenv(key, value)
    inner = FlowerErrors(4, {}, client_app=foreign_app(extra_mods=(failing_train,)))
    grid = with_availability(inner, "always", num_clients=4)
    with pytest.raises(NoWorkDone, match=r"the run ended.*any of its 2 round.*RuntimeError: no data on this device"):
        start(flower_fedavg(), grid, rounds=2)
    assert [(r["round"], r["participants"]) for r in read_metrics(tmp_path / "run")] == [(1, []), (2, [])]


def tensorboard_like_mod(msg: Message, context: Context, call_next):
    """Flower's custom-mods tensorboard_mod reads the round of every message it sees."""
    _ = msg.content["config"]["server-round"]
    return call_next(msg, context)


def test_a_mod_that_reads_the_config_like_flowers_tensorboard_mod_keeps_identity_working():
    inner = InProcessGrid(4, {}, client_app=foreign_app(extra_mods=(tensorboard_like_mod,)))
    grid = with_availability(inner, "always", num_clients=4, identity_timeout=5.0)
    start(flower_fedavg(), grid, rounds=2)
    assert [grid.rounds[r]["participants"] for r in (1, 2)] == [[0, 1, 2, 3]] * 2


RAY_REASON = """<class 'flwr.clientapp.client_app.ClientAppException'>:<'ray::ClientAppActor.run() (pid=1, ip=1.2.3.4)
  File "/x/ray_actor.py", line 61, in run
    out_message = app(message=message, context=context)
  File "/x/mods.py", line 88, in tensorboard_mod
    server_round = msg.content["config"]["server-round"]
KeyError: 'config'

The above exception was the direct cause of the following exception:

ray::ClientAppActor.run() (pid=1, ip=1.2.3.4)
  File "/x/ray_actor.py", line 64, in run
    raise ClientAppException(str(ex)) from ex
flwr.clientapp.client_app.ClientAppException:
Exception ClientAppException occurred. Message: 'config''>"""


@pytest.mark.parametrize("reason, quoted", [
    (RAY_REASON, "KeyError: 'config'"),  # simulation (Ray): the root of the chain, not the wrappers
    ("<class 'KeyError'>:<''lr''>", "KeyError: 'lr'"),  # a deployment's flwr-clientapp
    ("node 7 has no 'partition-id' in its node config\nmore", "node 7 has no 'partition-id' in its node config"),
])
def test_error_replies_are_quoted_as_their_real_exception(reason, quoted):
    assert quoted_error(reason) == quoted
