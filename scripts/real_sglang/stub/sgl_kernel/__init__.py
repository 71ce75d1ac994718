"""An import-only stand-in for `sgl_kernel`, SGLang's CUDA kernel package, which has no CPU build.

SGLang imports `sgl_kernel` at module level even on its CPU path. run.sh puts this folder first on PYTHONPATH so
those imports succeed; every attribute is a function that raises if it is ever called. The torch-native CPU path
that run.sh selects (--attention-backend torch_native --sampling-backend pytorch) calls none of them for the tiny
model, so a call here means the engine took a path this set-up does not support, and it should fail loudly.
"""

__version__ = "0.0.0-stub"


def __getattr__(name: str):
    if name.startswith("__"):  # dunder look-ups (e.g. __path__, __spec__) must fail the normal way
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} has no CPU implementation")

    _missing.__name__ = name
    return _missing
