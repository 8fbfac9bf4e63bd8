"""Personalized DP federated learning on the server: partial sharing and personalized evaluation.

`PersonalizedDPFedAvg` is DPFedAvg whose evaluation measures personalized models: every
client (or a seeded `fraction_evaluate` of them) evaluates its own personal model on its own
held-out split, and the metric is the unweighted mean over clients (DP²-FedSAM paper, Sec. V-A; docs/algorithms.md §4).
DP-FedAvg-FT / DP-FedSAM-FT use it with clients that fine-tune the global model first.

`PartialSharingDPFedAvg` (DP2-FedSAM, CENTAUR) holds, aggregates and broadcasts only the shared
body phi: DPFedAvg already works on whatever arrays it is given, so clipping, noise, top-up,
rejection (a reply carrying the head has the wrong number of arrays) and the ledger are its own.
Sensitivity and accounting are those of DPFedAvg with d = d_1 (body size).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import make_rng
from dpfl.strategies.dp_fedavg import DPFedAvg
from dpfl.strategies.loop.reply_gate import note_problem
from dpfl.strategies.parts.part import arrays_key, config_key, fraction_evaluate
from dpfl.strategies.parts.reply_rules import MetricRule, read_metrics
from dpfl.strategies.parts.sampling import pick

EVALUATION_RULES = {keys.ACCURACY: MetricRule(low=0.0, high=1.0), keys.LOSS: MetricRule(low=0.0)}


class PersonalizedDPFedAvg(DPFedAvg):
    """DPFedAvg with personalized evaluation each round.

    fraction_evaluate = 0 (default) evaluates every client; 0 < f < 1 a seeded sample of
    max(1, round(f * M)) clients. Round records carry `personalized_accuracy` (mean over
    clients), `personalized_accuracy_std`, `personalized_loss`, `personalized_clients`.
    Those metrics come from the clients' held-out data and, like any federated evaluation,
    are outside the DP guarantee (which covers the shared model updates): they are diagnostics
    (diagnostics.jsonl, diagnostics-summary.json), published only with publish-diagnostics.
    """

    def evaluation_nodes(self, server_round: int, node_ids: list[int]) -> list[int]:
        nodes = sorted(node_ids)
        if 0 < (fraction := fraction_evaluate(self)) < 1:
            k = max(1, round(fraction * len(nodes)))
            rng = make_rng(self.run.seed, 6, server_round)
            nodes = pick(rng, nodes, k)
        return nodes

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        nodes = self.evaluation_nodes(server_round, list(grid.get_node_ids()))
        record = RecordDict(
            {
                arrays_key(self): arrays,
                config_key(self): ConfigRecord({**dict(config), keys.SERVER_ROUND: server_round}),
            }
        )
        return [Message(content=record, dst_node_id=int(node), message_type=MessageType.EVALUATE) for node in nodes]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Unweighted mean over clients of their accuracy and loss (failed or empty replies are skipped)."""
        accuracies, losses, failures = [], [], 0
        for msg in replies:
            metrics, problem = (
                ({}, msg.error.reason) if msg.has_error() else read_metrics(msg.content, EVALUATION_RULES)
            )
            if problem is None and keys.ACCURACY not in metrics:
                problem = "no accuracy (empty held-out split?)"
            if problem:
                failures += 1
                note_problem(
                    self,
                    server_round,
                    f"no personalized evaluation from node {msg.metadata.src_node_id}: {problem}",
                )
                continue
            accuracies.append(metrics[keys.ACCURACY])
            losses.append(metrics.get(keys.LOSS, math.nan))
        if not accuracies:
            return None
        return MetricRecord(
            {
                "personalized_accuracy": float(np.mean(accuracies)),
                "personalized_accuracy_std": float(np.std(accuracies)),
                "personalized_loss": float(np.nanmean(losses)) if np.isfinite(losses).any() else math.nan,
                "personalized_clients": len(accuracies),
                "personalized_failures": failures,
            }
        )

    def client_evaluation_record(self, metrics: MetricRecord) -> dict:
        return dict(metrics)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "evaluation": (
                "personalized_accuracy (diagnostics-summary.json, not private): unweighted mean over "
                "clients of each client's personal model accuracy on its own held-out split"
            ),
        }

    def describe_diagnostics(self) -> dict:
        """DPFedAvg's diagnostics plus the last round's personalized evaluation."""
        last = next((r for r in reversed(self.record.history) if "personalized_accuracy" in r), {})
        keys = ("personalized_accuracy", "personalized_accuracy_std", "personalized_loss", "personalized_clients")
        return {**super().describe_diagnostics(), **{k: last.get(k) for k in keys}}


class PartialSharingDPFedAvg(PersonalizedDPFedAvg):
    """DP2-FedSAM / CENTAUR server: the arrays it starts from, aggregates and broadcasts are the body only.

    phi^{t+1} = phi^t + eta_s * (sum_i Delta_i + noise) / m  (Algorithm 2, line 25, with eta_s = 1);
    heads never reach the server.
    """

    def describe(self) -> dict:
        shared = self.round.arrays.to_numpy_ndarrays() if self.round.arrays is not None else []
        return {
            **super().describe(),
            "shared": "body only (each client keeps its head)",
            "shared_parameters": int(sum(a.size for a in shared)),
            "accuracy_note": (
                "final_accuracy is null: only the body is shared, so there is no global "
                "model to evaluate; see personalized_accuracy in diagnostics-summary.json"
            ),
        }
