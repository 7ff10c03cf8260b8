"""The names of every pluggable component, and the 16 presets: pure data, no torch.

The config validates `params.yaml` against these names before any model loads, and each registry
(estimators, KL estimators, loss aggregations, rollout backends, verifiers) must hold exactly the
names of its Literal here (a test asserts it). A preset names only what differs from the defaults of
`ResolvedAlgorithm` (eps 0.2/0.2, no dual clip, no entropy or NLL term, no whitening, gamma = lambda =
1, std ddof 0, eps 1e-6, no dynamic sampling, no overlong shaping); every component stays
overridable in params.yaml. docs/algorithms.md gives each one's formula.
"""

from typing import Literal

PresetName = Literal[
    "reinforce", "reinforce_kl_trick", "reinforce_pp", "reinforce_pp_baseline", "rloo", "remax", "ppo", "orz",
    "grpo", "grpo_r1", "dapo", "dr_grpo", "vapo", "grpo_process", "gspo", "cispo",
]  # fmt: skip
EstimatorName = Literal[
    "reinforce", "reinforce_kl_to_go", "reinforce_pp", "rloo", "remax", "gae",
    "group_norm", "group_mean", "group_process",
]  # fmt: skip
KLEstimatorName = Literal["k1", "k2", "k3"]
LossAggName = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "group-token-mean"
]
PolicyLossName = Literal["ppo_clip", "gspo", "cispo"]
LRScheduleName = Literal["constant", "linear_warmup", "cosine"]
PretrainLRScheduleName = Literal["constant", "cosine"]  # a pretraining phase has no warmup
VerifierTargetsName = Literal["outcome", "on_track"]
RolloutCorrectionName = Literal["none", "tis", "mis"]
RolloutBackendName = Literal["hf", "vllm"]
VerifierName = Literal["exact_match", "chain_steps", "marked_answer", "math"]
TaskName = Literal["addition", "chain", "reasoning"]

# Estimators that compare a response with the rest of its group: they need M >= 2.
GROUP_ESTIMATORS = ("rloo", "group_norm", "group_mean", "group_process")

# KL placed in the reward with k1 at beta = 0.01: the seed tables' REINFORCE-family setting.
_KL_IN_REWARD = {"kl_placement": "reward", "kl_estimator": "k1", "kl_beta": 0.01}
# KL placed in the loss with k3: DeepSeekMath's GRPO.
_KL_IN_LOSS = {"kl_placement": "loss", "kl_estimator": "k3"}

PRESETS: dict[str, dict[str, object]] = {
    "reinforce": {"estimator": "reinforce", **_KL_IN_REWARD, "loss_agg": "seq-mean-token-sum"},
    "reinforce_kl_trick": {
        "estimator": "reinforce_kl_to_go",
        **_KL_IN_REWARD,
        "loss_agg": "seq-mean-token-sum",
    },
    "reinforce_pp": {"estimator": "reinforce_pp", **_KL_IN_REWARD, "loss_agg": "token-mean"},
    # REINFORCE++-baseline (Hu 2025): the group mean subtracted, then whitened over the batch's tokens;
    # the KL in the loss with k2, as OpenRLHF runs it (--use_kl_loss --kl_estimator k2).
    "reinforce_pp_baseline": {
        "estimator": "group_mean",
        "whiten_advantages": True,
        "kl_placement": "loss",
        "kl_estimator": "k2",
        "kl_beta": 0.001,
        "loss_agg": "token-mean",
    },
    "rloo": {"estimator": "rloo", **_KL_IN_REWARD, "loss_agg": "seq-mean-token-sum"},
    "remax": {"estimator": "remax", **_KL_IN_REWARD, "loss_agg": "seq-mean-token-sum"},
    "ppo": {
        "estimator": "gae",
        "gamma": 1.0,
        "lam": 0.95,
        "lambda_critic": 0.95,
        **_KL_IN_REWARD,
        "loss_agg": "token-mean",
        "whiten_advantages": True,
    },
    # ORZ: GAE with lambda = gamma = 1 and no KL, so A_t = r - V_t; not whitened (it would bias ORZ).
    "orz": {
        "estimator": "gae",
        "gamma": 1.0,
        "lam": 1.0,
        "lambda_critic": 1.0,
        "kl_placement": "none",
        "kl_beta": 0.0,
        "loss_agg": "token-mean",
    },
    "grpo": {"estimator": "group_norm", **_KL_IN_LOSS, "kl_beta": 0.04, "loss_agg": "seq-mean-token-mean"},
    "grpo_r1": {"estimator": "group_norm", **_KL_IN_LOSS, "kl_beta": 0.001, "loss_agg": "seq-mean-token-sum"},
    "dapo": {
        "estimator": "group_norm",
        "kl_placement": "none",
        "kl_beta": 0.0,
        "loss_agg": "group-token-mean",
        "eps_low": 0.2,
        "eps_high": 0.28,
        "dynamic_sampling": True,
        "overlong_shaping": True,
    },
    "dr_grpo": {
        "estimator": "group_mean",
        "kl_placement": "none",
        "kl_beta": 0.0,
        "loss_agg": "seq-mean-token-sum-norm",
    },
    "vapo": {
        "estimator": "gae",
        "gamma": 1.0,
        "lam": "adaptive",
        "adaptive_lambda_alpha": 0.05,
        "lambda_critic": 1.0,
        "kl_placement": "none",
        "kl_beta": 0.0,
        "loss_agg": "token-mean",
        "eps_low": 0.2,
        "eps_high": 0.28,
        "nll_coef": 0.1,
        "dynamic_sampling": True,
    },
    # GSPO (Zheng 2025): one importance ratio per response, (pi / pi_old)^(1/|y|), clipped per response;
    # the clip range is the paper's (3e-4 / 4e-4: a length-normalised ratio moves little), no KL.
    "gspo": {
        "estimator": "group_norm",
        "policy_loss": "gspo",
        "kl_placement": "none",
        "kl_beta": 0.0,
        "loss_agg": "seq-mean-token-mean",
        "eps_low": 3e-4,
        "eps_high": 4e-4,
    },
    # CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped ratio with its gradient stopped, so that
    # clipped tokens keep their gradient; no lower bound in practice (eps_low 0.99 here), eps_high 0.28
    # (our choice: the paper tunes it), token-mean over the batch, no KL.
    "cispo": {
        "estimator": "group_norm",
        "policy_loss": "cispo",
        "kl_placement": "none",
        "kl_beta": 0.0,
        "loss_agg": "token-mean",
        "eps_low": 0.99,
        "eps_high": 0.28,
    },
    "grpo_process": {
        "estimator": "group_process",
        **_KL_IN_LOSS,
        "kl_beta": 0.04,
        "loss_agg": "seq-mean-token-mean",
    },
}
