"""minfer: a compact LLM inference engine, built chapter by chapter in the course."""
from minfer.llm import LLM
from minfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
