"""Execution-plan generator and paper-scale simulator (DESIGN §4-5): cost model, whole-iteration simulator,
migration decision, Rt sweep, plan search and the `rlhfuse-plan` CLI. Pure Python + numpy (no torch).
"""
