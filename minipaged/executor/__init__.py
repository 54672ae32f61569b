"""Executors (vLLM v1's ``vllm/v1/executor``): how a step's ``SchedulerOutput`` reaches the
worker(s). ``UniProcExecutor``: one worker in this process."""

from minipaged.executor.uniproc import UniProcExecutor

__all__ = ["UniProcExecutor"]
