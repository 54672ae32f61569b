"""The worker side of a step (vLLM v1's ``vllm/v1/worker``): ``ModelRunner`` keeps its own
requests and block tables, learned from ``SchedulerOutput`` alone, runs the model, samples
with ``minipaged.sample`` and, with speculative decoding, holds the drafter and the
rejection sampler. It returns a ``ModelRunnerOutput``: plain data, one token list per request."""

from minipaged.worker.model_runner import CachedRequestState, ModelRunner, ModelRunnerOutput

__all__ = ["CachedRequestState", "ModelRunner", "ModelRunnerOutput"]
