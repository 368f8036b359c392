"""qat4: Gemma 4 E2B from packed 4-bit QAT weights, disk to arithmetic."""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "Engine":
        from qat4.engine import Engine

        return Engine
    raise AttributeError(name)
