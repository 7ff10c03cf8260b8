"""Diagnostics: estimators compared on the same cached rollouts (`compare`), and the seed's
expected-value claims checked on an exact tabular environment (`expectations`)."""
