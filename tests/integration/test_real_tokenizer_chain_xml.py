"""The real-tokenizer chain (tests/integration/test_real_tokenizer_chain.py) on Qwen3.5's
tokenizer and its XML tool calls, read by vLLM's ``qwen3_coder`` parser: SFT, an evaluation
with a call parsed by vLLM's parser and run in the sandbox, and the entropy's
normalisation, in a file of their own so that pytest-xdist runs the two chains on
different workers. The RL steps through the launcher run on Qwen3's chain only: the
learner/actor agreement they check is the same code for both families (151,936 or
248,320 logits), and the Qwen3.5 run cost the suite 134 s."""

from __future__ import annotations

import pytest

from tests.integration.test_real_tokenizer_chain import (  # noqa: F401  (collected here)
    _chain,
    test_round_entropy_is_normalised_as_the_reference_does,
    test_sft_then_evaluation_with_a_call_in_the_sandbox,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
chain = pytest.fixture(scope="module", params=["qwen3.5"])(_chain)
