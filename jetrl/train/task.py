"""Re-export of `jetrl.tasks.arithmetic` (the task moved to `jetrl.tasks`, shared with the verl path)."""

from jetrl.tasks.arithmetic import ArithmeticTask, Problem, Stream, compute_score, score

__all__ = ["Problem", "ArithmeticTask", "Stream", "score", "compute_score"]
