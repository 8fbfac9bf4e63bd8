"""The keys that strategies and clients exchange: the train config the server sends, and the
metrics a client reports. Both sides use these names; neither spells the strings itself.
"""

# Train config: server -> client.
SERVER_ROUND = "server-round"
PRIVATIZE = "privatize"  # clip to CLIPPING_NORM (and add a noise share of NOISE_STD) before upload
CLIPPING_NORM = "clipping-norm"
NOISE_STD = "noise-std"
SPARSITY = "sparsity"  # top-k: fraction p of coordinates kept
TOPK_MODE = "topk-mode"
SECURE_AGGREGATION = "secure-aggregation"  # the upload goes into a SecAgg+ sum
LOCAL_STEPS = "local-steps"  # also reported back: steps taken
LOCAL_EPOCHS = "local-epochs"
LEARNING_RATE = "lr"
RELEASE_MU = "release-mu"  # ALI-DPFL: release a noisy mu estimate
SPENT_STEPS = "spent-steps"  # ALI-DPFL: the DP-SGD steps the server has charged the receiving node so far
SPENT_MU_RELEASES = "spent-mu-releases"  # ALI-DPFL: the mu releases charged to the receiving node so far

# Metrics: client -> server.
NUM_EXAMPLES = "num-examples"
UPLOAD_KIND = "dpfl-upload"  # UPLOAD_UPDATE: the arrays are the (privatized) update; absent: the client's weights
UPLOAD_UPDATE = 1
UPDATE_NORM = "update-norm"  # ||Delta||_2 before clipping
TRAIN_LOSS = "train-loss"
HEAD_LOSS = "head-loss"
HEAD_STEPS = "head-steps"
FINE_TUNE_STEPS = "fine-tune-steps"
KEPT_VALUES = "kept-values"  # top-k: coordinates uploaded
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"  # ALI-DPFL: the node config's, to look its partition's public size up
DPSGD_STEPS = "dpsgd-steps"  # cumulative DP-SGD steps on this client's data
MU_RELEASES = "mu-releases"  # cumulative mu releases
MU = "mu"
EPSILON = "epsilon"  # the client's own sample-level ledger
EPSILON_CLAIMED = "epsilon-claimed"
BUDGET_LEFT = "budget-left"  # 1 if one more DP-SGD step fits the budget
ACCURACY = "accuracy"
LOSS = "loss"
# Local DP (clients.local_dp): what the client's own ledger says, in its train reply.
LOCAL_NOISE_MULTIPLIER = "local-noise-multiplier"  # sigma of its local Gaussian noise (std sigma C)
LOCAL_EPSILON_ROUND = "local-epsilon-round"  # epsilon of this one release, on its own
LOCAL_EPSILON = "local-epsilon"  # composed over the rounds this client took part in
LOCAL_ROUNDS = "local-rounds"  # rounds this client took part in
LOCAL_DELTA = "local-delta"
# Adaptive clipping (strategies.parts.adaptive_clipping, clients.adaptive_clipping).
CLIP_COUNT_NOISE_STD = "clip-count-noise-std"  # train config: the std of the client's share of the count noise
CLIP_BIT = "clip-bit"  # metric: (1[||Delta|| <= C] - 1/2) + the client's share of the count noise
# Sample-level DP in a user's own Opacus client (clients.opacus_ledger): its ledger across rounds.
SAMPLE_EPSILON = "sample-epsilon"  # cumulative, at SAMPLE_DELTA
SAMPLE_DELTA = "sample-delta"
SAMPLE_STEPS = "sample-steps"  # DP-SGD steps charged so far
SAMPLE_ACCOUNTANT = "sample-accountant"  # whose bound SAMPLE_EPSILON is (legacy replies only: a string)
# The client's identity (strategies.parts.sampling.ClientIdentities asks, clients.identity answers): a message of
# type CLIENT_ID_QUERY to each node the server has not seen, answered with CLIENT_ID in the CLIENT_IDENTITY record.
CLIENT_ID_ACTION = "client_id"
CLIENT_ID_QUERY = f"query.{CLIENT_ID_ACTION}"  # Flower's message type "<category>.<action>"
CLIENT_IDENTITY = "client-identity"  # the reply's ConfigRecord
CLIENT_ID = "client-id"  # its client id; also the node-config key that sets it (else the node's partition-id)
MAX_CLIENT_ID = 2**53  # a client id is an integer in [0, 2^53): exact in a float64 and in JSON
# Node cohorts (dpcore.privacy.packing, strategies.loop.node_cohorts): a SuperNode hosting several clients answers the identity
# query with CLIENT_IDS (a JSON list) instead of CLIENT_ID; the server's one message to such a node and the node's one
# reply carry each client's records once packed, listed in the COHORT_INDEX record.
CLIENT_IDS = "client-ids"  # the hosted clients' ids; also the node-config key that names them ("0,5,9")
NUM_CLIENTS = "num-clients"  # run config: the client population, hosted by the nodes (0: one client a node)
COHORT_INDEX = "cohort-index"  # the ConfigRecord that lists which packed records make each client's content
