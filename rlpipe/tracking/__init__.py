"""Tracking: MLflow through one daemon per pipeline execution (`client` in the stages, `daemon` beside them)."""
