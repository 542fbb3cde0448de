"""Judging model output: the sandbox for model-written code, benchmark tasks and their oracles, metrics with intervals, and scoring samples."""
