"""Optuna search over the kernel twins' declared spaces; winners are stored as data."""
