"""The serving engine: scheduler, KV pool, model runner and sampler over one Gemma 4 model."""

from qat4.engine.config import EngineConfig
from qat4.engine.engine import Engine, StepOutput
from qat4.engine.generation import Generation
from qat4.engine.memory import default_dtype
from qat4.engine.sampler import SamplingParams

__all__ = ["Engine", "EngineConfig", "Generation", "SamplingParams", "StepOutput", "default_dtype"]
