"""Training: the one loop skeleton (`loop`) and what steps through it: the policy update (`policy`), the
critic (`critic`: value pretraining and the per-round update), the SFT warm start (`sft`); data parallelism
(`distributed`, `torchrun`)."""
