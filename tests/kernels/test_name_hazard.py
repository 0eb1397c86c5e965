"""Our top-level package `kernels` shares its name with Hugging Face's kernel-hub
package, which transformers looks up by distribution version. transformers must never
take ours for its own (it would try to load hub kernels through it)."""

import importlib.metadata

from transformers.utils import import_utils


def test_transformers_does_not_take_our_kernels_package():
    from pathlib import Path

    import kernels

    # `kernels` resolves to ours (beside engine/ in this repository) ...
    assert (Path(kernels.__file__).parent.parent / "engine" / "__init__.py").exists()
    # ... and transformers, which accepts only its own version range, ignores it.
    assert not import_utils.is_kernels_available()


def test_no_hub_kernels_distribution_installed_beside_ours():
    # Both in one environment would shadow each other; our distribution is `batchgen`.
    owners = importlib.metadata.packages_distributions().get("kernels", [])
    assert set(owners) <= {"batchgen"}, f"another distribution provides `kernels`: {owners}"
