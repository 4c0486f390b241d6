"""Constants shared by the maths, the replay and the configuration (one home, no copies)."""

import math

LN2 = math.log(2.0)
# |log p - log q| beyond this changes a JS term by < e^-100; clamping keeps -inf entries finite (no NaN).
MAX_LOG_RATIO = 100.0

# Elements of [contexts, tokens, vocab] fp32 logits per chunk of the torch JS path (8 MB): bounds replay memory; on
# CPU larger chunks were not faster (benchmarks/js_kernel.py --sweep-chunk). Every chunk streams the whole lm_head
# weight, so it keeps at least MIN_CHUNK_TOKENS tokens: at V=152064, K=3 one 3-token chunk took 16.4 s, 8 tokens
# 11.0 s (same inputs).
DEFAULT_CHUNK_ELEMENTS = 1 << 21
MIN_CHUNK_TOKENS = 8
# The replay's memory on CUDA (docs/kernels.md), sized once per run from the memory usable when it first replays
# (free, plus reserved and unused): each divergence chunk holds REPLAY_CHUNK_ROWS fp32 vocabulary rows (3K + 1 per
# token for the torch rule, K + 1 for the kernel; by the roofline the GEMM is compute-bound from about 440 rows), at
# most REPLAY_CHUNK_SHARE of it; the hidden states held at once (one stream of responses) at most REPLAY_STATES_SHARE,
# and a decoder forward's activations and cache at most REPLAY_FORWARD_SHARE.
REPLAY_CHUNK_ROWS = 2048
REPLAY_CHUNK_SHARE = 0.25
REPLAY_STATES_SHARE = 0.05
REPLAY_FORWARD_SHARE = 0.10
# Vocabulary columns per tile of the sampled-token log-probabilities (TRL's ChunkedLogProbFunction).
VOCAB_TILE = 4096

# Replay defaults: sequences per forward, and the fewest new tokens a shared context prefix needs to run once.
REPLAY_BATCH_SIZE = 8
MIN_SHARED_PREFIX = 16  # a shorter shared prefix is not worth its own forward
# Tokens of a packed replay row (unless one sequence is longer): the dense mask makes every token of a row attend over
# the whole row, so the attention's work per token grows with it, while a shorter row leaves more forwards.
PACKED_ROW_TOKENS = 512
# The start-up check of a model's replay path (replay.check_replay_path): how far the replayed logits may be from the
# model's own forward, relative to the largest, in a 16-bit dtype (fp32: 1e-3). Two summation orders of a bf16 forward
# differ by a few of its units (2^-8) at each layer; a wrong position or a state carried across sequences moves the
# logits by a large part of their range.
PROBE_HALF_TOLERANCE = 0.05

# what divergence_backend may name: "triton" is ops/triton_divergence.py, imported only by a run that names it
DIVERGENCE_BACKENDS = ("auto", "torch", "triton")
CREDIT_ASSIGNMENTS = ("mrtpo", "gdpo", "grpo")

# Per-reward strength (MRTPOConfig.reward_strength): momentum of the running specificity, and how often a reward
# whose strength is 0 is still replayed, so that its reading can recover.
STRENGTH_MOMENTUM = 0.9
STRENGTH_PROBE_INTERVAL = 10
NEGATIVE_Q_TOLERANCE = 1e-6  # q from a provider in [-1e-6, 0) is rounding and reads as 0; below it is refused

# A local model folder that is a copy of a Hub model names its id in this file (the embedded model's conversion writes
# it): adapters and model cards then name the Hub id, which whoever downloads them can load.
HUB_ID_FILE = "hub_id.txt"
# In the embedded models' folders: the name trl_mrtpo.scripts.embedded.local_model loads the folder by (a model card
# of a run on one loads its base that way, offline).
LOCAL_MODEL_FILE = "local_model.txt"
