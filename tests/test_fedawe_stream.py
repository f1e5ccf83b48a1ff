"""FedAWE and FedPBC stream (issue 36, item 6): their fold gives the numbers of holding every reply.

The reference is the ``aggregate`` FedAWE ran before it streamed (every reply of the round held,
weighted sums over the round's rows in client order), kept here as :func:`held_aggregate`; a rule
class with it holds every reply (its ``aggregate`` is written outside ``strategies``). Over random
configs (derandomized hypothesis): equal or num-examples weights, the clip on or off (and biting),
η_g, echo factors above 1 (clients keep their copies as the client rule does, so the consistency
check passes), random arrival orders, rounds with no reply, several rounds (x̄ and ``xbar-gap``),
FedPBC's options; and, below the intake, plain reports (a client without the rule) mixed in.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict
from hypothesis import given, settings, strategies as st
from replies import Grid1, start_round

from strategies import build_strategy, named_arrays
from strategies.replies import ClientReport
from strategies.rules.fedawe import ECHO_FACTOR, FACTOR, UPDATE, UPDATE_PREFIX, EchoReport, FedAWE
from strategies.rules.fedpbc import FedPBC
from strategies.weighting import weighted_sum

D, N = 9, 8


def clip_norm(v: np.ndarray, threshold: float) -> np.ndarray:
    norm = float(np.linalg.norm(v))
    return v * (threshold / norm) if threshold > 0 and norm > threshold else v


def xbar_metrics(self, x):
    return {} if self.xbar is None else {"xbar-gap": float(np.linalg.norm(self.xbar - x))}


def held_aggregate(self, t, x, reports):
    """FedAWE's ``aggregate`` before it streamed (commit 8ac7a83), verbatim but for names."""
    echoes = [EchoReport.of(r) for r in reports]
    self._adopters = (t + 1, [r.node_id for r in echoes])
    for r in echoes:
        self.last_accepted[r.client_id] = t
    if not echoes:
        return x, xbar_metrics(self, x)
    w = self.weights(reports)
    u = np.asarray(weighted_sum(w, [r.echo_update for r in echoes]), np.float64)
    moved = weighted_sum(w, [r.delta for r in echoes])
    new = np.add(x, moved, dtype=np.float64)
    norm = float(np.linalg.norm(u))
    metrics = {"mean-echo-factor": float(np.mean([r.echo_factor for r in echoes])), "echo-update-norm": norm}
    if self.clip > 0:
        new = new + self.server_lr * (clip_norm(u, self.clip) - u)
        metrics["echo-clipped"] = float(norm > self.clip)
    new = new.astype(np.float32)
    if self.xbar is not None:
        m = len(reports)
        starts = np.multiply(x, m, dtype=np.float64)
        if self.weighting == "equal":
            starts += np.multiply(moved, m, dtype=np.float64)
            echoed = u * m
        else:
            ones = np.ones(m)
            starts += weighted_sum(ones, [r.delta for r in echoes])
            echoed = np.asarray(weighted_sum(ones, [r.echo_update for r in echoes]), np.float64)
        echoed *= self.server_lr
        starts -= echoed
        step = np.multiply(new, m, dtype=np.float64)
        step -= starts
        step /= self.require_num_clients()
        self.xbar = self.xbar + step
    return new, {**metrics, **xbar_metrics(self, new)}


class HeldFedAWE(FedAWE):
    aggregate = held_aggregate


class HeldFedPBC(FedPBC):
    aggregate = held_aggregate


SPECS = ["fedawe", "fedpbc", "fedpbc:code-step=first-commit", "fedpbc:catch-up=true"]


def build(spec: str, held: bool, weighting: str, clip: float, server_lr: float):
    name, _, options = spec.partition(":")
    if held:
        cls = HeldFedAWE if name == "fedawe" else HeldFedPBC
        kwargs = {k.replace("-", "_"): {"true": True}.get(v, v) for k, v in (o.split("=") for o in options.split(",") if o)}
        return cls(num_clients=N, weighting=weighting, clip=clip, server_lr=server_lr, seed=3, **kwargs)
    return build_strategy(f"{spec}{',' if options else ':'}clip={clip}", num_clients=N, weighting=weighting,
                          server_lr=server_lr, seed=3)


def echo_reply(sent: Message, copy: np.ndarray, step: np.ndarray, factor: int, lr: float, client: int,
               examples: int) -> Message:
    """What the client rule replies: x_i^† = x_i + η_g (t − τ_i) Δ_i from its copy x_i, u_i = (t − τ_i) Δ_i."""
    u = (factor * step).astype(np.float32)
    arrays = {"w": (copy + np.float32(lr) * u).astype(np.float32), ECHO_FACTOR: np.array([float(factor)]),
              UPDATE_PREFIX + "w": u}
    return Message(RecordDict({"arrays": named_arrays(arrays),
                               "metrics": MetricRecord({"num-examples": examples, "client-id": client})}),
                   reply_to=sent)


def play(s, rounds, seed):
    """Each round's (x^{t+1}, metrics, round log, broadcast nodes) with N simulated clients that
    keep their copies (x^0 at first; x^{t+1} after an accepted reply) and τ_i."""
    rng = np.random.default_rng(seed)
    x0 = rng.normal(size=D).astype(np.float32)
    copies, tau, x, out = {c: x0.copy() for c in range(N)}, dict.fromkeys(range(N), -1), x0, []
    for rnd, (present, order) in enumerate(rounds, start=1):
        t = rnd - 1
        sent = start_round(s, rnd, x, [100 + c for c in range(N)])
        echo = s.name == "fedawe"
        replies = [echo_reply(sent[100 + c], copies[c], rng.normal(size=D).astype(np.float32) * rng.uniform(0.5, 2),
                              t - tau[c] if echo else 1, s.server_lr, c, int(rng.integers(1, 50))) for c in present]
        replies = [replies[i] for i in order if i < len(replies)]  # arrival order
        arrays, metrics = s.aggregate_train(rnd, replies)
        x = arrays["w"].numpy()
        nodes = [m.metadata.dst_node_id for m in s.configure_broadcast(rnd, arrays, Grid1(sent))]
        for c in s.round_log.participants:
            copies[c], tau[c] = x.copy(), t
        log = s.round_log
        out.append((x.copy(), dict(metrics), (log.participants, log.rejected, log.unavailable), nodes))
    return out


rounds_st = st.lists(st.tuples(st.lists(st.integers(0, N - 1), max_size=N, unique=True),
                               st.permutations(range(N))), min_size=2, max_size=4)


@given(spec=st.sampled_from(SPECS), rounds=rounds_st, seed=st.integers(0, 2**16),
       weighting=st.sampled_from(["equal", "num-examples"]), clip=st.sampled_from([0.0, 0.5, 50.0]),
       server_lr=st.sampled_from([1.0, 0.7]))
@settings(max_examples=30, deadline=None, derandomize=True)
def test_streaming_fedawe_and_fedpbc_give_the_hold_all_numbers(spec, rounds, seed, weighting, clip, server_lr):
    server_lr = 1.0 if "catch-up" in spec else server_lr
    (streamed, s1), (held, s2) = [(play(s := build(spec, held, weighting, clip, server_lr), rounds, seed), s)
                                  for held in (False, True)]
    assert s1.reason_held() == "" and "writes its own aggregate" in s2.reason_held()
    for (x1, m1, log1, nodes1), (x2, m2, log2, nodes2) in zip(streamed, held, strict=True):
        assert log1 == log2 and not log1[1]  # every reply honest and accepted, the same participants
        assert nodes1 == nodes2  # the postponed broadcast: the round's participants, in client order
        np.testing.assert_allclose(x1, x2, rtol=0, atol=1e-6)
        assert m1.keys() == m2.keys()
        for key in m1:
            assert m1[key] == pytest.approx(m2[key], rel=1e-6, abs=1e-6), key
    # x̄ sums every round's float32 changes in another order: a few ulp apart (6.4e-7 relative seen at
    # |x̄| = 2.25, where 1e-6 absolute is 4 ulp), so the bound is relative as well
    np.testing.assert_allclose(s1.xbar, s2.xbar, rtol=2e-6, atol=1e-6)
    assert s1.last_accepted == s2.last_accepted


@pytest.mark.parametrize("weighting", ["equal", "num-examples"])
@pytest.mark.parametrize("clip", [0.0, 0.3])
@pytest.mark.parametrize("rule", [FedAWE, FedPBC])
def test_the_fold_takes_plain_reports_as_the_held_aggregate_did(rule, clip, weighting):
    """Below the intake (``aggregate``, ``start_fold``) a plain report, from a client without the
    rule, counts as echo factor 1 and u_i = Δ_i (:meth:`EchoReport.of`): folded in any order, with
    unnormalised or held weights, FedAWE's reports beside plain ones give the held aggregate's numbers."""
    rng = np.random.default_rng(7)
    held_cls = HeldFedAWE if rule is FedAWE else HeldFedPBC
    strategies = [cls(num_clients=N, clip=clip, weighting=weighting, server_lr=0.8) for cls in (rule, rule, held_cls)]
    x = rng.normal(size=D).astype(np.float32)
    for t in range(3):
        for s in strategies:
            start_round(s, t + 1, x, [100 + c for c in range(N)])
        reports = []
        for c in sorted(rng.choice(N, size=int(rng.integers(1, N)), replace=False).tolist()):
            delta = rng.normal(size=D).astype(np.float32)
            r = ClientReport(client_id=c, node_id=100 + c, delta=delta, num_examples=int(rng.integers(1, 40)))
            if c % 2:  # a FedAWE reply: echo factor, u_i
                factor = 1 if rule is FedPBC else int(rng.integers(1, t + 2))
                r.payloads = {FACTOR: np.array([factor], np.float32), UPDATE: (factor * delta / 0.8).astype(np.float32)}
                r.payload_norms = {UPDATE: float(np.linalg.norm(r.payloads[UPDATE]))}
            reports.append(r)
        held, folded = strategies[2].aggregate(t, x, reports), strategies[0].aggregate(t, x, reports)
        fold = strategies[1].start_fold(t, x)
        for i in rng.permutation(len(reports)):  # arrival order, unnormalised weights
            fold.add(reports[i])
        for new, metrics in (folded, fold.finish()):
            np.testing.assert_allclose(new, held[0], rtol=0, atol=1e-6)
            assert metrics == pytest.approx(held[1], rel=1e-6, abs=1e-6)
        assert [s._adopters for s in strategies[:2]] == [strategies[2]._adopters] * 2
        x = held[0]
    for s in strategies[:2]:
        np.testing.assert_allclose(s.xbar, strategies[2].xbar, rtol=0, atol=1e-6)
        assert s.last_accepted == strategies[2].last_accepted
