"""Pure tensor math of the algorithms in docs/algorithms.md: no I/O, no config objects in the math.

- `kl`: KL estimators k1, k2, k3.
- `advantages`: the nine advantage estimators, whitening, the length-adaptive lambda.
- `aggregation`: the five loss-aggregation modes, as per-token weights from whole-minibatch counts.
- `losses`: clipped surrogate (eps_low / eps_high, dual clip) and the clipped value loss.
- `objective`: the policy loss of one micro-batch (surrogate + KL + entropy + NLL terms).
- `presets`: the 16 presets (pure data; imported by `rlpipe.config`, so this package imports no torch).
- `build`: the one place that maps a resolved algorithm spec onto the math's plain-number arguments:
  `compute_round_advantages`, `minibatch_loss_setup`, `policy_loss`, `token_coefficient`,
  `zero_variance_groups`, `dynamic_sampling_keep`.

The registries (`ADVANTAGE_ESTIMATORS`, `KL_ESTIMATORS`, `LOSS_AGGREGATIONS`) are `rlpipe.registry.Registry`
instances, shared with the rollout-backend and verifier families.
"""
