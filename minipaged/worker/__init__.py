"""The worker side of a step (vLLM v1's ``vllm/v1/worker``): ``ModelRunner`` keeps its own
requests and block tables, learned from ``SchedulerOutput`` alone, and runs the model."""

from minipaged.worker.model_runner import CachedRequestState, ModelRunner, ModelRunnerOutput

__all__ = ["CachedRequestState", "ModelRunner", "ModelRunnerOutput"]
