"""Triton kernels run for real on a CUDA machine and in Triton's CPU interpreter otherwise.
TRITON_INTERPRET must be set before triton is first imported by any test module (a kernel
module imported without it defines its helpers for the GPU, and interpreted kernels then
cannot call them), hence here, at the root of the tests."""

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language (inspect.getmembers over three modules,
    ~5 ms) at every call of a @triton.jit helper from a kernel, once per program per call
    site, although the launch already patched the same modules and restores them when it
    ends. Helpers of the kernels under test are called tens of thousands of times: a third
    of an interpreted MoE test went there. Skip the repeat when the helper sees only modules
    the running launch (or an earlier helper in it) patched; anything else goes through
    Triton's own patching as before.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_class is None:  # another Triton: leave it as it is
        return
    running: list[set[int]] = []  # ids of the modules the running launch patched

    def languages(fn) -> set[int]:
        values = fn.__globals__.values()
        return {id(v) for v in values if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_once(fn):
        if running:  # a helper called inside a running launch
            wanted = languages(fn)
            if wanted <= running[-1]:
                return scope_class()
            # Triton never restores what a helper's call patched: from here on, for the
            # rest of this launch, those modules are patched too.
            running[-1] |= wanted
            return patch_lang(fn)
        scope = patch_lang(fn)  # a launch: patched until its restore()
        running.append(languages(fn))
        restore = scope.restore

        def restore_and_end() -> None:
            running.pop()
            restore()

        scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = patch_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()


DEFAULT_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def default_model_path():
    """The embedded default model's GGUF file, or a skip when it is not available offline."""
    from engine.loader import catalog

    path = catalog.available_path(catalog.CATALOG[DEFAULT_MODEL])
    if path is None:
        pytest.skip("the default model file is not available offline (.ci/run installs it)")
    return path


@pytest.fixture(scope="session")
def default_model_llm(default_model_path):
    """The default model on the CPU in float32, built once for every test that runs it: a
    load takes ~15 s on 2 cores, most of it transformers parsing the GGUF metadata for the
    tokenizer. Up to 8 sequences and a 256 MiB KV cache (5,800 tokens): tests give it a few
    short rows, and the 2 GiB default would stay resident for the whole session."""
    from engine import LLM

    return LLM(DEFAULT_MODEL, dtype="float32", max_num_seqs=8, kv_cache_memory=256 << 20)
