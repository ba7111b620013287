"""The GPT-2 example proves itself the way any model plugin does: the conformance kit, unchanged."""

from titan_core.testing import model_conformance

test_gpt2_conformance = model_conformance(["model=gpt2_tiny"])
