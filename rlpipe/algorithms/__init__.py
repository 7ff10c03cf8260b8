"""Pure tensor math of the algorithms in ALGORITHMS.md: no I/O, no config objects in the math.

- `kl`: KL estimators k1, k2, k3.
- `advantages`: the nine advantage estimators, whitening, the length-adaptive lambda.
- `aggregation`: the five loss-aggregation modes, as per-token weights from whole-minibatch counts.
- `losses`: clipped surrogate (eps_low / eps_high, dual clip) and the clipped value loss.
- `objective`: the policy loss of one micro-batch (surrogate + KL + entropy + NLL terms).
- `presets`: the 13 presets (pure data; imported by `rlpipe.config`, so this package imports no torch).
- `build`: the one place that maps a resolved algorithm spec onto the math's plain-number arguments.
"""
