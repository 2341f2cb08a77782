"""The real-tokenizer chain (tests/integration/test_real_tokenizer_chain.py) on Qwen3.5's
tokenizer and its XML tool calls, read by vLLM's ``qwen3_coder`` parser: the same tests,
in a file of their own so that pytest-xdist runs the two chains on different workers."""

from __future__ import annotations

import pytest

from tests.integration.test_real_tokenizer_chain import (  # noqa: F401  (collected here)
    _chain,
    test_rl_steps_through_the_launcher_agree_at_step_one,
    test_round_entropy_is_normalised_as_the_reference_does,
    test_sft_then_evaluation_with_a_call_in_the_sandbox,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
chain = pytest.fixture(scope="module", params=["qwen3.5"])(_chain)
